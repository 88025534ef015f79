"""What transformers + compressed-tensors build when they load a compressed-tensors checkpoint,
checked against the checkpoint's tensors, so an export whose layout the loader rejects (or
misreads) cannot pass validation.

transformers has two routes, picked by the quantization_config's `dequantize`:
  * compressed (default): a model built on the meta device, `apply_quantization_config`, then
    compressed-tensors' `compress_model` turns each quantized Linear's parameters into the
    stored layout; the checkpoint tensors must match those parameters name for name and shape
    for shape (the load report's MISMATCH / MISSING), and the first forward decompresses them;
  * dense (`dequantize: true`): float Linears, and each module's stored tensors go through
    compressed-tensors' decompressor at load; the decompressed weight must be the weight the
    export encodes.
Both are asked of the installed packages, not re-implemented here: the check follows the
versions the user loads with. Without compressed-tensors installed it is skipped, naming the
package a user needs to load the export in transformers.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

from quantlab.export.checks import Report
from quantlab.quant.primitives import QuantizedWeight

RULE = "transformers load layout"


def check(report: Report, path: Path, qcfg: dict[str, Any], tensors: dict[str, torch.Tensor],
          quantized: dict[str, QuantizedWeight]) -> None:
    """`quantized`: every Linear as the format's reader decodes it (the weights the export means)."""
    if importlib.util.find_spec("compressed_tensors") is None:
        report.skip(RULE, "compressed-tensors is not installed: `pip install compressed-tensors` to load this "
                          "export in transformers (and to check it against that loader here)")
        return
    from transformers import CompressedTensorsConfig

    hf_config = CompressedTensorsConfig.from_dict(dict(qcfg))
    versions = f"transformers {version('transformers')} + compressed-tensors {version('compressed-tensors')}"
    report.facts["transformers route"] = "dense (dequantize at load)" if hf_config.dequantize else "compressed"
    if hf_config.dequantize and any(".experts." in name for name in quantized):
        # measured with transformers 5.23/5.24 (tests/test_moe.py loads the symmetric ones)
        report.skip(RULE, f"{versions} cannot load asymmetric packed MoE experts (its converter that stacks "
                          "experts drops weight_zero_point); export symmetric weights to load them in transformers")
        return
    if hf_config.dequantize:
        _check_dense_route(report, hf_config, tensors, quantized, versions)
    else:
        _check_compressed_route(report, path, hf_config, tensors, quantized, versions)


def _module_tensors(tensors: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    prefix = f"{name}."
    return {k.removeprefix(prefix): v for k, v in tensors.items()
            if k.startswith(prefix) and "." not in k.removeprefix(prefix) and k != f"{name}.bias"}


def _one_per_shape(quantized: dict[str, QuantizedWeight]) -> dict[str, QuantizedWeight]:
    """The first Linear of each distinct shape: enough to prove a layout, cheap on large models."""
    seen: dict[tuple[int, ...], str] = {}
    for name, qw in quantized.items():
        seen.setdefault(tuple(qw.codes.shape), name)
    return {name: quantized[name] for name in seen.values()}


def _check_dense_route(report: Report, hf_config: Any, tensors: dict[str, torch.Tensor],
                       quantized: dict[str, QuantizedWeight], versions: str) -> None:
    from compressed_tensors.compressors import BaseCompressor

    ct_config = hf_config.quantization_config
    scheme = next(iter(ct_config.config_groups.values()))
    compressor = BaseCompressor.get_value_from_registry(scheme.format or ct_config.format)
    for name, qw in _one_per_shape(quantized).items():
        try:
            weight = compressor.decompress(_module_tensors(tensors, name), scheme)["weight"].float()
        except Exception as exc:  # the loader's own failure, reported as the export's
            report.check(RULE, name, False, f"{versions} cannot decompress it: {type(exc).__name__}: {exc}")
            continue
        want = qw.dequantize()
        report.check(RULE, name, weight.shape == want.shape and bool(torch.allclose(weight, want, rtol=1e-3, atol=0)),
                     f"{versions} decompresses a different weight than the export encodes")


def _check_compressed_route(report: Report, path: Path, hf_config: Any, tensors: dict[str, torch.Tensor],
                            quantized: dict[str, QuantizedWeight], versions: str) -> None:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import apply_quantization_config
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    config.quantization_config = None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    compressor = ModelCompressor.from_compression_config(hf_config)
    with contextlib.redirect_stderr(io.StringIO()):  # compressed-tensors' progress bars
        apply_quantization_config(model, compressor.quantization_config, run_compressed=False)
        compressor.compress_model(model)
    built: dict[str, dict[str, tuple[int, ...]]] = {}  # module → its parameters' shapes, bias aside
    for key, value in model.state_dict().items():
        module, param = key.rsplit(".", 1)
        if param != "bias":
            built.setdefault(module, {})[param] = tuple(value.shape)
    for name in quantized:
        stored, params = _module_tensors(tensors, name), built.get(name, {})
        wrong = [f"{k} {list(t.shape)} where the loader builds {list(params[k])}" for k, t in stored.items()
                 if k in params and tuple(t.shape) != params[k]]
        missing = sorted(set(params) - set(stored))
        report.check(RULE, name, not wrong and not missing,
                     f"{versions}: " + "; ".join(wrong + [f"no {k}, which the loader builds" for k in missing]))
