"""quantlab: post-training quantization and calibration for large language models."""

__version__ = "0.1.0"
