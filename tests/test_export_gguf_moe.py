"""GGUF export of Qwen3 (per-head q/k norms) and the mixture-of-experts families (Mixtral,
Qwen2-MoE, Qwen3-MoE: llama.cpp's stacked expert tensors), proven by real loaders:
llama.cpp (llama-cpp-python, in its tool environment) scores the same windows as quantlab's
fake-quant model, logits and NLL, and transformers' GGUF loader (qwen3, qwen3_moe; it reads
Mixtral's `llama` arch as a dense Llama) computes exactly the weights quantlab's reader decodes.

One W4 g32 symmetric RTN canonical form per family, exported once as Q4_0; routers ×30 so
routing is decisive (a near-tie would let last-bit differences between engines pick other
experts, as in tests/test_moe.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import tiny_model
from quantlab.algorithms.rtn import RTN
from quantlab.engine.sequential import run_sequential
from quantlab.errors import UserError
from quantlab.export import api
from quantlab.models.arch import arch_spec_for
from quantlab.models.moe import unfuse_experts
from quantlab.quant.canonical import load_canonical, load_fake_quant_model, save_canonical
from quantlab.quant.scheme import WeightScheme

pytest.importorskip("gguf")

CPU = torch.device("cpu")
SCHEME = WeightScheme(bits=4, symmetric=True, group_size=32)
MOE_TYPES = ["mixtral", "qwen2_moe", "qwen3_moe"]
# llama.cpp's qwen3moe always renormalizes the top-k weights (as the released Qwen3-MoE configs say)
OVERRIDES = {"qwen3_moe": {"norm_topk_prob": True}}


def _ids(n: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 512, (n, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).logits.float()


def _nll(logits: torch.Tensor, ids: torch.Tensor) -> float:
    """Summed NLL of ids[:, 1:] (as gguf_nll.py sums it)."""
    logp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
    return float(-logp.gather(-1, ids[:, 1:, None]).sum())


pytestmark = pytest.mark.usefixtures("one_thread")


FAMILIES = ["qwen3", *MOE_TYPES]


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tokenizer):
    """`exports(model_type)` → (model_type, canonical dir, gguf-q4_0 export dir), made once per family."""
    made: dict[str, tuple[str, Path, Path]] = {}

    def get(model_type: str) -> tuple[str, Path, Path]:
        if model_type not in made:
            made[model_type] = _export(model_type, tmp_path_factory, tokenizer)
        return made[model_type]

    return get


@pytest.fixture(params=FAMILIES)
def exported(request, exports) -> tuple[str, Path, Path]:
    return exports(request.param)


def _export(model_type: str, tmp_path_factory, tokenizer) -> tuple[str, Path, Path]:
    model = tiny_model(model_type, seed=4, **OVERRIDES.get(model_type, {}))
    if model_type in MOE_TYPES:
        unfuse_experts(model)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.mul_(30)
    quantized = run_sequential(model, arch_spec_for(model), _ids(4, 32, 0), [RTN(SCHEME)], CPU, batch_size=4)
    root = tmp_path_factory.mktemp(f"gguf-{model_type}")
    save_canonical(root / "quantized", model, quantized, tokenizer)
    report = api.export(root / "quantized", root / "gguf", "gguf-q4_0")
    assert report.ok, report
    return model_type, root / "quantized", root / "gguf"


def test_file_layout_and_reader_round_trip(exported):
    """Experts stacked `[E, out, in]` as Q4_0 block rows, routers F32, q/k norms F32; the reader
    gives every expert back under its own name with the canonical codes (fp16-rounded scales)."""
    import gguf

    model_type, canonical, out = exported
    reader = gguf.GGUFReader(next(out.glob("*.gguf")))
    tensors = {t.name: t for t in reader.tensors}
    shape = {n: tuple(int(x) for x in reversed(t.shape.tolist())) for n, t in tensors.items()}
    kind = {n: t.tensor_type.name for n, t in tensors.items()}
    side = json.loads((out / "quantlab_export.json").read_text())
    if model_type == "qwen3":
        assert shape["blk.1.attn_q_norm.weight"] == (16,) and kind["blk.1.attn_k_norm.weight"] == "F32"
        assert kind["blk.0.ffn_gate.weight"] == "Q4_0"
    else:
        inter = 96 if model_type == "mixtral" else 32
        assert shape["blk.1.ffn_gate_exps.weight"] == (4, inter, 64) == shape["blk.1.ffn_up_exps.weight"]
        assert shape["blk.1.ffn_down_exps.weight"] == (4, 64, inter)
        assert kind["blk.1.ffn_down_exps.weight"] == "Q4_0"
        assert shape["blk.0.ffn_gate_inp.weight"] == (4, 64) and kind["blk.0.ffn_gate_inp.weight"] == "F32"
        assert side["modules"]["model.layers.1.mlp.experts.2.down_proj"] == {
            "tensor": "blk.1.ffn_down_exps.weight", "expert": 2, "type": "Q4_0", "encoding": "transcoded"}
        assert ("blk.0.attn_q_norm.weight" in tensors) == (model_type == "qwen3_moe")
        meta = reader.fields
        arch = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}[model_type]
        assert meta[f"{arch}.expert_count"].contents() == 4 and meta[f"{arch}.expert_used_count"].contents() == 2
    if model_type == "qwen2_moe":
        assert shape["blk.0.ffn_gate_shexp.weight"] == (64, 64) and shape["blk.0.ffn_down_shexp.weight"] == (64, 64)
        assert shape["blk.0.ffn_gate_inp_shexp.weight"] == (64,)  # llama.cpp declares it `{n_embd}`
        assert reader.fields["qwen2moe.expert_shared_feed_forward_length"].contents() == 64

    from quantlab.export import gguf_file

    floats, _ = gguf_file.read(out)
    tensors_ref, quantized = load_canonical(canonical)
    assert set(side["modules"]) == set(quantized)
    for name, qw in quantized.items():
        got = floats[f"{name}.weight"]
        idx = qw.g_idx.long()
        bound = (qw.codes.float() + qw.zeros.float()[:, idx] + 1) * qw.scales[:, idx] * 2**-10
        assert bool(((got - qw.dequantize()).abs() <= bound).all()), name
    routers = [n for n in tensors_ref if n.endswith(("mlp.gate.weight", "shared_expert_gate.weight"))]
    assert len(routers) == 2 * {"qwen3": 0, "qwen2_moe": 2}.get(model_type, 1)
    assert all(torch.equal(floats[n], tensors_ref[n].float()) for n in routers)


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_validator_catches_swapped_experts(exports, model_type, tmp_path):
    """Two experts' block rows swapped in a stacked tensor: the validator's decoded weights of
    exactly those two experts differ from the canonical ones."""
    import gguf

    from quantlab.export import gguf_file

    _, _, out = exports(model_type)
    bad = out.parent / f"gguf-broken-{tmp_path.name}"  # beside the original: the sidecar's source resolves
    shutil.copytree(out, bad)
    reader = gguf.GGUFReader(next(bad.glob("*.gguf")), "r+")
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_up_exps.weight")
    t.data[[1, 3]] = t.data[[3, 1]]
    reader.data.flush()
    del reader
    failed = {(c.rule, c.subject) for c in gguf_file.validate(bad).failures}
    assert failed == {("decoded weights", f"model.layers.0.mlp.experts.{e}.up_proj") for e in (1, 3)}


def test_llama_cpp_scores_like_the_fake_quant_model(exported):
    """llama.cpp (its own Q4_0 × Q8_0 kernels, Q8_0 embedding, F16 KV cache) on the same token
    windows: logits within 3 % of the fake-quant model's largest logit (the q4_0 bar of the
    transformers check in tests/test_export_loaders.py; seen: 1.1–1.8 %, while two swapped
    experts or a flipped k_proj move them 8–67 %), and the NLL within 0.02 % (seen: < 0.003 %).
    The logits are the discriminating check: a random tiny model's NLL sits near ln(vocab)
    whatever its weights."""
    from quantlab.export import engine_check

    model_type, canonical, out = exported
    ids = _ids(2, 32, seed=6)
    result = engine_check.score(out, ids, logits=True)
    ref = _logits(load_fake_quant_model(canonical), ids)
    got = result["logits"]
    assert got.shape == ref.shape
    assert float((got - ref).abs().max()) < 3e-2 * float(ref.abs().max()), model_type
    assert result["nll_sum"] == pytest.approx(_nll(ref, ids), rel=2e-4)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])  # transformers reads mixtral's llama arch as dense
def test_transformers_computes_what_the_reader_decodes(exports, model_type):
    """transformers' GGUF loader (qwen3, qwen3_moe): exactly the weights quantlab's reader
    decodes (names, the expert un-stacking into fused `gate_up_proj`), close to the fake-quant
    model. The model is built from the canonical config: transformers' GGUF config map drops
    `attention.key_length` (qwen3: head_dim falls back to 128) and `expert_feed_forward_length`
    (qwen3_moe: moe_intermediate_size falls back to 768), which only real checkpoints match."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantlab.export import gguf_file

    _, canonical, out = exports(model_type)
    loaded = AutoModelForCausalLM.from_pretrained(out, gguf_file=next(out.glob("*.gguf")).name,
                                                  config=AutoConfig.from_pretrained(canonical),
                                                  dtype=torch.float32).eval()
    decoded = load_fake_quant_model(canonical)
    floats, _ = gguf_file.read(out)
    missing, unexpected = decoded.load_state_dict(floats, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    ids = _ids(2, 24, seed=7)
    got = _logits(loaded, ids)
    assert torch.allclose(got, _logits(decoded, ids), atol=1e-5, rtol=0)
    ref = _logits(load_fake_quant_model(canonical), ids)
    assert float((got - ref).abs().max()) < 3e-2 * float(ref.abs().max())


REFUSED = {  # per family: a config change llama.cpp would compute differently, and the refusal
    "qwen3": ({"use_sliding_window": True, "sliding_window": 8}, r"qwen3 with sliding_window=8: llama\.cpp's qwen3 "
              "attends to the whole context"),
    "qwen3_moe": ({"norm_topk_prob": False}, r"qwen3_moe with norm_topk_prob=False: llama\.cpp's qwen3moe always"),
    "qwen2_moe": ({"norm_topk_prob": True}, r"qwen2_moe with norm_topk_prob=True: llama\.cpp's qwen2moe never"),
    "mixtral": ({"sliding_window": 8}, r"mixtral with sliding_window=8: llama\.cpp's llama attends to the whole"),
}


def test_configs_llama_cpp_computes_differently_are_refused(exported, tmp_path):
    model_type, canonical, _ = exported
    change, match = REFUSED[model_type]
    copy = tmp_path / "quantized"
    shutil.copytree(canonical, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(UserError, match=match):
        api.export(copy, tmp_path / "out", "gguf-q4_0")
    assert not (tmp_path / "out").exists()
