"""Export the canonical quantized form to the formats inference engines load, read exports back
and validate them. One module per format (`awq`, `gptq`, `compressed_tensors`, `gguf_file`,
`trtllm`, `paddlenlp`), each with `write`, `read`, `validate` and `matches` (and `read_scales`
where the format carries activation / KV-cache scales); `api` ties them together."""

from quantlab.formats import FORMATS, ExportFormat

__all__ = ["FORMATS", "ExportFormat"]
