"""Lazy loading (quantlab.models.lazy) against `from_pretrained` on the real SmolLM2 checkpoint:
the same bits in every tensor, and the same canonical form when quantized block by block."""

from __future__ import annotations

import pytest
import torch

from quantlab.algorithms.rtn import RTN
from quantlab.engine.linear_error import LinearErrors
from quantlab.engine.sequential import run_sequential
from quantlab.eval.divergence import divergence
from quantlab.eval.perplexity import perplexity
from quantlab.models.arch import arch_spec_for
from quantlab.models.builtin import float_checkpoint
from quantlab.models.lazy import lazy_model
from quantlab.models.sources import ResolvedModel, load_model
from quantlab.quant.canonical import canonical_model, canonical_writer, layer_tensors, load_canonical, load_fake_quant_model
from quantlab.quant.scheme import PRESETS
from quantlab.recipe import ModelSpec

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")
ALIAS = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def checkpoint():
    return float_checkpoint(ALIAS)


@pytest.fixture(scope="module")
def eager(checkpoint):
    """Loaded once: the first tests read it, the last one quantizes it in place."""
    return _eager_float(checkpoint)


def test_lazy_tensors_are_the_eager_bits(checkpoint, eager):
    model, store = lazy_model(checkpoint, torch.float32)
    expected = eager.state_dict()
    layers = arch_spec_for(model).decoder_layers(model)
    assert all(p.is_meta for p in layers.parameters())  # nothing of the layers read yet
    for name, tensor in model.state_dict().items():
        if not tensor.is_meta:
            assert torch.equal(tensor, expected[name]), name
    for index in (0, len(store) - 1):
        layer = store.load(index, CPU)
        for name, tensor in layer.state_dict().items():
            assert torch.equal(tensor, expected[f"model.layers.{index}.{name}"]), name
        store.release(index)
        assert all(p.is_meta for p in layer.parameters())


def test_perplexity_layer_by_layer_is_the_whole_model_perplexity(checkpoint, eager):
    """Evaluated first (module order): `eager` is still the float model here."""
    stream = torch.randint(0, 49152, (3 * 64,), generator=torch.Generator().manual_seed(1))
    expected = perplexity(eager, stream, 64)
    model, store = lazy_model(checkpoint, torch.float32)
    streamed = perplexity(model, stream, 64, layers=store)
    assert streamed.mean_nll == expected.mean_nll and streamed.windows == 3


def _quantize_to(target, model, store, ids):
    """RTN W4 g128 with the output-error measurement (one calibration batch runs every
    layer), each block written as it finishes, as the quantize stage does."""
    with canonical_writer(target) as writer:
        def sink(block):
            writer.add_block(layer_tensors(block.prefix, block.layer, block.quantized),
                             {block.full_name(n): qw for n, qw in block.quantized.items()})

        run_sequential(model, arch_spec_for(model), ids, [RTN(PRESETS["W4A16"])], CPU, batch_size=2,
                       errors=LinearErrors(tokens=64), layers_from=store, sink=sink)
        writer.finish(model, _NoTokenizer())


class _NoTokenizer:
    def save_pretrained(self, _path):
        pass


def test_lazy_quantize_writes_the_eager_canonical_form(checkpoint, eager, tmp_path):
    ids = torch.randint(0, 49152, (2, 32), generator=torch.Generator().manual_seed(0))
    _quantize_to(tmp_path / "eager", eager, None, ids)
    model, store = lazy_model(checkpoint, torch.float32)
    _quantize_to(tmp_path / "lazy", model, store, ids)
    assert (tmp_path / "lazy" / "model.safetensors.index.json").is_file()  # one shard per block
    eager_tensors, eager_codes = load_canonical(tmp_path / "eager")
    lazy_tensors, lazy_codes = load_canonical(tmp_path / "lazy")
    assert eager_tensors.keys() == lazy_tensors.keys() and eager_codes.keys() == lazy_codes.keys()
    assert len(lazy_codes) == 30 * 7
    assert all(torch.equal(eager_tensors[k], lazy_tensors[k]) for k in eager_tensors)
    for name, qw in eager_codes.items():
        other = lazy_codes[name]
        assert torch.equal(qw.codes, other.codes) and torch.equal(qw.scales, other.scales), name
    # the fake-quant model read layer by layer from the canonical shards: the same divergence
    stream = torch.randint(0, 49152, (2 * 64,), generator=torch.Generator().manual_seed(2))
    whole = divergence(_eager_float(checkpoint), load_fake_quant_model(tmp_path / "lazy"), stream, 64)
    float_model, float_layers = lazy_model(checkpoint, torch.float32)
    quant_model, quant_layers = canonical_model(tmp_path / "lazy")
    streamed = divergence(float_model, quant_model, stream, 64, reference_layers=float_layers,
                          candidate_layers=quant_layers)
    assert streamed.to_dict() | {"seconds": 0} == whole.to_dict() | {"seconds": 0}
    assert streamed.mean_kld > 0


def _eager_float(checkpoint):
    return load_model(ModelSpec(id=ALIAS), ResolvedModel("builtin", str(checkpoint), None, None))
