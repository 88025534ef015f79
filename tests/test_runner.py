"""The bundled runner: float logits equal transformers', every quantized backend and the
int8/fp8 KV cache compute what the fake-quant model computes, generation is deterministic and
batch-independent, and `quantlab generate` / the verify stage work end to end."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from quantlab.cli import app
from quantlab.eval.fake_quant import apply_from_canonical
from quantlab.quant.canonical import load_fake_quant_model, save_canonical
from quantlab.quant.primitives import QuantizedWeight, quantize_weight
from quantlab.quant.scheme import PRESETS, ActivationScheme, WeightScheme
from quantlab.runner import from_hf_model, generate, load_runner
from quantlab.runner import linear as rl
from quantlab.runner.verify import compare
from conftest import WIKI_TEST, tiny_model

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def ids_of(shape: tuple[int, int], seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 512, shape, generator=torch.Generator().manual_seed(seed))


def assert_near(ours: torch.Tensor, ref: torch.Tensor, tol: float) -> float:
    """Max abs error within `tol` of the reference's scale; returns the error."""
    err, scale = (ours - ref).abs().max().item(), ref.abs().max().item()
    assert err <= tol * scale, f"max abs error {err:.3g} vs {tol:.0e} × {scale:.3g}"
    return err


def lively(model_type: str = "llama", **overrides) -> torch.nn.Module:
    """A tiny model with larger weights: peaked next-token distributions, so greedy text varies."""
    model = tiny_model(model_type, seed=3, initializer_range=0.25, **overrides)
    if model_type == "qwen2":  # non-trivial q/k/v biases
        with torch.no_grad():
            for layer in model.model.layers:
                for name in ("q_proj", "k_proj", "v_proj"):
                    getattr(layer.self_attn, name).bias.normal_()
    return model


# --------------------------------------------------------------------------- float runner


@pytest.mark.parametrize("model_type,overrides", [
    ("llama", {}), ("qwen2", {}), ("qwen3", {}), ("gemma3_text", {}), ("mistral", {"sliding_window": 6}),
    ("mixtral", {}), ("qwen2_moe", {}), ("qwen3_moe", {"norm_topk_prob": True}),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 16}}),
])
def test_float_runner_matches_transformers(model_type, overrides):
    model = lively(model_type, **overrides)
    runner = from_hf_model(model)
    ids = ids_of((2, 24))
    with torch.no_grad():
        ref = model(ids).logits
    assert_near(runner.full_logits(ids), ref, 1e-5)
    # step by step through the KV cache: the same logits as the full forward
    runner.setup_caches(2, 32)
    steps = [runner(ids[:, :5], torch.arange(5), attend_len=5)]
    steps += [runner(ids[:, t:t + 1], torch.tensor([t]), attend_len=t + 1) for t in range(5, 24)]
    assert_near(torch.cat(steps, 1), ref, 1e-5)


def test_full_cache_attention_equals_sliced():
    """Decode over the whole static cache (CUDA-graph shape) masks the unused positions."""
    runner = from_hf_model(lively())
    ids = ids_of((1, 12), 1)
    runner.setup_caches(1, 40)
    runner(ids[:, :11], torch.arange(11), attend_len=11)
    sliced = runner(ids[:, 11:], torch.tensor([11]), attend_len=12)
    full = runner(ids[:, 11:], torch.tensor([11]))
    assert_near(full, sliced, 1e-5)


# --------------------------------------------------------------------------- quantized runner


def canonical(tmp: Path, tokenizer, scheme: WeightScheme, acts: ActivationScheme | None = None,
              kv: dict | None = None, act_order: bool = False, model_type: str = "llama") -> Path:
    """A canonical dir made by RTN over every Linear, plus activation/KV schemes and ranges."""
    model = lively(model_type)
    quantized: dict[str, QuantizedWeight] = {}
    for i, layer in enumerate(model.model.layers):
        for name in LINEARS:
            qw = quantize_weight(layer.get_submodule(name).weight.detach(), scheme)
            if act_order:  # a GPTQ desc_act g_idx: groups permuted over the columns
                perm = torch.randperm(qw.g_idx.numel(), generator=torch.Generator().manual_seed(i))
                qw = QuantizedWeight(qw.codes, qw.scales, qw.zeros, qw.g_idx[perm].contiguous(), scheme)
            quantized[f"model.layers.{i}.{name}"] = qw
    extra, scales = {}, observed_ranges(model)
    names = list(quantized)
    if acts is not None:
        extra["activations"] = {**acts.model_dump(), "modules": names}
    if kv is not None:
        extra["kv_cache"] = {**kv, "modules": [f"model.layers.{i}.self_attn" for i in range(len(model.model.layers))]}
    target = tmp / "quantized"
    save_canonical(target, model, quantized, tokenizer, extra, scales=scales)
    return target


def observed_ranges(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Input absmax of every Linear and per-head K/V absmax on a few random sequences (what
    the act_ranges stage records), so the 8-bit grids are realistic, not all clipping."""
    from quantlab.quant import kv_cache

    scales: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            def hook(_m, args, name=name):
                scales[f"{name}.input_absmax"] = args[0].abs().max().detach()
            hooks.append(module.register_forward_pre_hook(hook))
    kv_cache.enable(model)
    with contextlib.ExitStack() as stack, torch.no_grad():
        ranges = {f"model.layers.{i}.self_attn": stack.enter_context(kv_cache.observe_kv(layer.self_attn))
                  for i, layer in enumerate(model.model.layers)}
        model(ids_of((2, 24), 99))
    for h in hooks:
        h.remove()
    for attn, rng in ranges.items():
        scales[f"{attn}.k_absmax"], scales[f"{attn}.v_absmax"] = rng.k, rng.v
    return scales


def fake_quant(source: Path) -> torch.nn.Module:
    model = load_fake_quant_model(source)
    apply_from_canonical(model, source)
    return model


STATIC_INT8 = ActivationScheme(dynamic=False, granularity="tensor")
CASES = {
    "w4a16_g16": (WeightScheme(bits=4, symmetric=True, group_size=16), None, None, False, rl.WNA16Linear),
    "w4a16_asym_actorder": (WeightScheme(bits=4, symmetric=False, group_size=16), None, None, True, rl.WNA16Linear),
    "w8a16": (PRESETS["W8A16"], None, None, False, rl.WNA16Linear),
    "w3_dequantized": (WeightScheme(bits=3, group_size=32), None, None, False, rl.DenseLinear),
    "w8a8_token": (PRESETS["W8A16"], ActivationScheme(), None, False, rl.W8A8Linear),
    "w8a8_asym_static_kv_int8": (PRESETS["W8A16_ASYM"], STATIC_INT8, {"type": "int", "granularity": "head"},
                                 False, rl.W8A8Linear),
    "fp8_token_kv_fp8": (PRESETS["FP8"], ActivationScheme(type="float"), {"type": "float", "granularity": "head"},
                         False, rl.FP8Linear),
    "fp8_tensor_static_kv_int8_tensor": (PRESETS["FP8_PER_TENSOR"], ActivationScheme(
        type="float", dynamic=False, granularity="tensor"), {"type": "int", "granularity": "tensor"}, False, rl.FP8Linear),
    "w4a8_fallback": (WeightScheme(bits=4, group_size=32), ActivationScheme(), None, False, rl.QuantInput),
}


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_runner_matches_fake_quant(case, tmp_path, tokenizer):
    scheme, acts, kv, act_order, backend = CASES[case]
    source = canonical(tmp_path, tokenizer, scheme, acts, kv, act_order)
    runner = load_runner(tmp_path)  # the run dir: quantized/ is found
    o_proj = runner.model.layers[0].self_attn.o_proj
    assert isinstance(o_proj, backend), type(o_proj)
    if act_order:
        assert o_proj.packed.perm is not None and isinstance(runner.model.layers[0].self_attn.qkv, rl.Concat)
    elif backend is not rl.QuantInput:
        assert isinstance(runner.model.layers[0].self_attn.qkv, backend)  # q/k/v fused into one GEMM
    if kv is not None:
        assert runner.model.layers[0].self_attn.kv_quant.kind == ("int8" if kv["type"] == "int" else "fp8")
    ids = ids_of((2, 20), 4)
    fq = fake_quant(source)
    with torch.no_grad():
        ref = fq(ids).logits
        weights_only = load_fake_quant_model(source)(ids).logits
    ours = runner.full_logits(ids)
    err = (ours - ref).abs().max().item()
    assert err < 2e-4 * ref.abs().max().item(), err
    if acts is not None or kv is not None:  # the activation / KV numerics are really applied
        assert (weights_only - ref).abs().max().item() > 20 * err
    # decoding token by token through the (quantized) cache gives the same logits
    runner.setup_caches(2, 20)
    steps = [runner(ids[:, :8], torch.arange(8), attend_len=8)]
    steps += [runner(ids[:, t:t + 1], torch.tensor([t]), attend_len=t + 1) for t in range(8, 20)]
    assert (torch.cat(steps, 1) - ref).abs().max().item() < 2e-4 * ref.abs().max().item()


def test_qwen2_quantized_biases(tmp_path, tokenizer):
    source = canonical(tmp_path, tokenizer, PRESETS["W8A16"], ActivationScheme(), model_type="qwen2")
    ids = ids_of((1, 16), 5)
    with torch.no_grad():
        ref = fake_quant(source)(ids).logits
    assert (load_runner(source).full_logits(ids) - ref).abs().max().item() < 2e-4 * ref.abs().max().item()


def test_verify_compare_reports_agreement_and_errors(tmp_path, tokenizer):
    source = canonical(tmp_path, tokenizer, WeightScheme(bits=4, group_size=16), None,
                       {"type": "int", "granularity": "head"})
    prompts = [ids_of((1, 6), s)[0].tolist() for s in range(3)]
    result = compare(load_runner(source), fake_quant(source), prompts, max_new_tokens=12)
    assert result["greedy_agreement"] == 1.0 and result["tokens_compared"] == 36
    assert result["prompts_fully_agreeing"] == 3 and len(result["layers"]) == 2
    assert result["logits"]["rel"] < 1e-5
    assert all(row["max_abs"] < 1e-4 for row in result["layers"])
    floor = result["reference_floor"]  # the float64 copy really recomputes: near, not identical
    assert 0 < floor["logits_rel"] < 1e-3 and 0.5 <= floor["greedy_agreement"] <= 1
    # against a different model (float weights) the same measure sees the quantization
    other = compare(load_runner(source), load_fake_quant_model(source), prompts, max_new_tokens=12, floor=False)
    assert other["reference_floor"] is None
    assert other["logits"]["rel"] > 100 * result["logits"]["rel"]


# --------------------------------------------------------------------------- generation


def test_batch_of_unequal_prompts_equals_each_alone():
    runner = from_hf_model(lively())
    prompts = [ids_of((1, 9), 7)[0].tolist(), ids_of((1, 4), 8)[0].tolist(), ids_of((1, 6), 9)[0].tolist()]
    batch = generate(runner, prompts, 10)
    alone = torch.cat([generate(runner, [p], 10).tokens for p in prompts])
    assert torch.equal(batch.tokens, alone)
    assert len({tuple(r) for r in alone.tolist()}) == 3 and len(set(alone[0].tolist())) > 2  # real text, not a constant


def test_decode_step_is_rebuilt_when_the_fused_path_toggles():
    """A kept decode step holds one path (a captured graph records it): switching the fused
    batch-1 step on or off must not reuse the other path's step."""
    from quantlab.runner.generate import decode_step

    runner = from_hf_model(lively())
    runner.setup_caches(1, 32)
    first = decode_step(runner, "eager")
    assert decode_step(runner, "eager") is first
    runner.fused_layers = True  # set_fused_decode's flag (on CPU it stays off: no Triton GEMV)
    assert decode_step(runner, "eager") is not first


def test_compiled_prefill_equals_eager_over_prompt_lengths(monkeypatch):
    """The compiled prefill runs every decoder layer through one function compiled with dynamic
    shapes: left-padded batches of several prompt lengths generate what the eager prefill does,
    from a single traced graph for all layers and lengths (Inductor's code generation is left
    out here: the `aot_eager` backend traces the same graph); a compile failure under "auto"
    falls back to eager with a warning."""
    import importlib

    gen = importlib.import_module("quantlab.runner.generate")
    compile_ = torch.compile
    monkeypatch.setattr(gen.torch, "compile", lambda fn, **kw: compile_(fn, backend="aot_eager", fullgraph=True, **kw))
    runner = from_hf_model(lively("qwen2"))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # earlier tests' compiles count too
    for lengths in ((9, 4, 6), (5, 12, 7)):
        prompts = [ids_of((1, k), 20 + k)[0].tolist() for k in lengths]
        want = generate(runner, prompts, 6, prefill="eager", max_seq_len=32).tokens
        got = generate(runner, prompts, 6, prefill="compile", max_seq_len=32)  # caches as large
        assert torch.equal(got.tokens, want) and got.stats["prefill"] == "compile"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler")

    runner.setup_caches(1, 32)
    step = gen.Prefill(runner, "auto")
    step.mode, step._layer = "compile", broken
    with pytest.warns(UserWarning, match="prefilling eagerly"):
        logits = step(ids_of((1, 5)))
    assert step.mode == "eager" and logits.shape == (1, runner.args.vocab_size)


def test_greedy_matches_transformers_generate():
    model = lively("qwen2")
    runner = from_hf_model(model)
    prompt = ids_of((1, 7), 10)
    hf = model.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, 7:]
    assert torch.equal(generate(runner, [prompt[0].tolist()], 12).tokens[0], hf)


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    runner = from_hf_model(lively())
    prompts = [ids_of((1, 5), 11)[0].tolist()] * 2
    a = generate(runner, prompts, 16, temperature=1.5, seed=1).tokens
    b = generate(runner, prompts, 16, temperature=1.5, seed=1).tokens
    c = generate(runner, prompts, 16, temperature=1.5, seed=2).tokens
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert not torch.equal(a[0], a[1])  # rows draw their own samples
    greedy = generate(runner, prompts, 16).tokens
    assert torch.equal(generate(runner, prompts, 16, temperature=0.7, top_k=1, seed=3).tokens, greedy)


def test_eos_stops_rows_and_streams_every_step():
    runner = from_hf_model(lively())
    prompt = ids_of((1, 5), 12)[0].tolist()
    free = generate(runner, [prompt, prompt[1:]], 12).tokens
    eos = int(free[0, 3])
    seen = []
    out = generate(runner, [prompt, prompt[1:]], 12, eos_token_id=eos, pad_token_id=-1, on_token=seen.append)
    assert out.lengths[0] == int((free[0] == eos).float().argmax()) + 1
    first = out.lengths[0]
    assert (out.tokens[0, first:] == -1).all() and torch.equal(out.tokens[0, :first], free[0, :first])
    assert len(seen) == out.tokens.shape[1]


# --------------------------------------------------------------------------- CLI and recipe stage


def test_cli_generate_streams_text(tmp_path, tokenizer, tiny_model_dir):
    canonical(tmp_path, tokenizer, PRESETS["W4A16"])
    cli = CliRunner()
    result = cli.invoke(app, ["generate", str(tmp_path), "--prompt", "The history of", "--max-new-tokens", "6",
                              "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() and "tokens in" in result.stderr
    assert "--fused-decode" not in result.stderr  # the default takes the fused step only where it applies
    asked = cli.invoke(app, ["generate", str(tmp_path), "--prompt", "The history of", "--max-new-tokens", "6",
                             "--device", "cpu", "--fused-decode", "--attention", "torch"])
    assert asked.exit_code == 0 and asked.stdout == result.stdout  # on a CPU: unfused, and said so
    assert "--fused-decode: this model or device does not take it" in asked.stderr
    sampled = cli.invoke(app, ["generate", str(tmp_path), "--prompt", "The", "--temperature", "1", "--top-k", "5",
                               "--seed", "4", "--max-new-tokens", "4", "--device", "cpu"])
    assert sampled.exit_code == 0, sampled.output
    for args, field in ((["--temperature", "-1"], "--temperature"), (["--top-k", "0"], "--top-k"),
                        (["--max-new-tokens", "0"], "--max-new-tokens"), (["--decode", "fast"], "--decode"),
                        (["--decode", "graphs", "--device", "cpu"], "--decode"),
                        (["--attention", "flash"], "--attention")):
        bad = cli.invoke(app, ["generate", str(tmp_path), "--prompt", "x", *args])
        assert bad.exit_code == 2 and field in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    float_dir = cli.invoke(app, ["generate", str(tiny_model_dir), "--prompt", "The", "--max-new-tokens", "3",
                                 "--device", "cpu"])
    assert float_dir.exit_code == 0, float_dir.output
    missing = cli.invoke(app, ["generate", str(tmp_path / "nope"), "--prompt", "x"])
    assert missing.exit_code == 2 and "nope" in missing.stderr


def test_verify_stage_writes_its_report_section(tiny_model_dir, tmp_path):
    from quantlab.pipeline import run_recipe
    from quantlab.recipe import validate_recipe

    raw = {"name": "v", "seed": 0, "device": "cpu", "model": {"id": str(tiny_model_dir)},
           "stages": [{"rtn": {"weights": {"bits": 4, "group_size": 32}}}],
           "evaluate": {"perplexity": {"dataset": {"source": str(WIKI_TEST)}, "seq_len": 32, "max_windows": 1}},
           "verify": {"num_prompts": 2, "prompt_tokens": 8, "max_new_tokens": 4, "perplexity_windows": 2,
                      "seq_len": 32},
           "output": {"dir": str(tmp_path / "run")}}
    run = run_recipe(validate_recipe(raw))
    report = json.loads((run.path / "reports" / "report.json").read_text())
    v = report["verify"]
    assert v["prompts"] == 2 and v["tokens_compared"] == 8 and v["greedy_agreement"] == 1.0
    assert v["perplexity"]["runner"]["windows"] == 2
    assert abs(v["perplexity"]["rel_diff_pct"]) < 1e-3
    md = (run.path / "reports" / "report.md").read_text()
    assert "## Runner verification" in md and "| 1 |" in md


def test_verify_in_float64_compares_what_is_computed(tiny_model_dir, tmp_path):
    """verify.precision float64: W8A8 with per-token dynamic int8 activations, both sides in
    float64 on the CPU — no activation code flips on rounding, so the runner agrees on every
    token and its logits match to float64 rounding; no floor is measured (the reference is
    already float64)."""
    from quantlab.pipeline import run_recipe
    from quantlab.recipe import validate_recipe

    raw = {"name": "v64", "seed": 0, "device": "cpu", "model": {"id": str(tiny_model_dir)},
           "calibration": {"dataset": {"source": str(WIKI_TEST)}, "num_samples": 2, "seq_len": 32},
           "stages": [{"rtn": {"weights": "W8A16"}},
                      {"act_ranges": {"activations": {"type": "int", "dynamic": True, "granularity": "token"}}}],
           "verify": {"num_prompts": 2, "prompt_tokens": 8, "max_new_tokens": 6, "perplexity_windows": 1,
                      "seq_len": 32, "precision": "float64", "dataset": {"source": str(WIKI_TEST)}},
           "output": {"dir": str(tmp_path / "run")}}
    run = run_recipe(validate_recipe(raw))
    v = json.loads((run.path / "reports" / "verify.json").read_text())
    assert v["dtype"] == "float64" and v["greedy_agreement"] == 1.0
    assert v["logits"]["rel"] < 1e-12 and v["reference_floor"] is None
    assert abs(v["perplexity"]["rel_diff_pct"]) < 1e-8
    # decode steps (the cache, the decode attention) compute what the whole-sequence pass does
    runner = load_runner(run.path, "cpu", torch.float64)
    seq = torch.randint(0, runner.args.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    full = runner.full_logits(seq)[0]
    runner.setup_caches(1, 16)
    steps = [runner(seq[:, :8], torch.arange(8), attend_len=8, last_only=True)[0, -1]]
    steps += [runner(seq[:, i:i + 1], torch.tensor([i]))[0, -1] for i in range(8, 12)]
    assert (torch.stack(steps) - full[7:]).abs().max() < 1e-10


def test_verify_recipe_needs_prompts_or_data(tmp_path):
    from quantlab.errors import UserError
    from quantlab.recipe import validate_recipe

    raw = {"name": "v", "seed": 0, "model": {"id": "m"}, "stages": [{"rtn": {}}], "verify": {}}
    with pytest.raises(UserError, match="verify.perplexity_windows: needs a dataset"):
        validate_recipe(raw)
    with pytest.raises(UserError, match="verify.prompts"):
        validate_recipe({**raw, "verify": {"perplexity_windows": 0}})
    ok = validate_recipe({**raw, "verify": {"perplexity_windows": 0, "prompts": ["Hello"]}})
    assert ok.verify.max_new_tokens == 64
    with pytest.raises(UserError, match="verify.max_new_tokens"):
        validate_recipe({**raw, "verify": {"max_new_tokens": 0, "prompts": ["x"], "perplexity_windows": 0}})


def test_decode_benchmark_smoke(tmp_path):
    """benchmarks/decode.py --tiny runs on CPU and writes its JSON and Markdown."""
    import importlib.util

    from conftest import REPO

    spec = importlib.util.spec_from_file_location("decode_bench", REPO / "benchmarks" / "decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--tiny", "--schemes", "hf-bf16,bf16,w4a16,fp8,w4a16-head", "--batches", "2", "--prompts", "16",
                "--repeats", "1", "--new-tokens", "4", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "decode_cpu_tiny.json").read_text())
    assert [r["scheme"] for r in res["rows"]] == ["hf-bf16", "bf16", "w4a16", "fp8", "w4a16-head"]
    assert all(r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["batch"] == 2 for r in res["rows"])
    assert res["versions"]["torch"] == torch.__version__ and [b["bar"] for b in res["bars"]] == []
    assert "| w4a16 | 2 |" in (tmp_path / "decode_cpu_tiny.md").read_text()
    gb = {r["scheme"]: r["weight_gb"] for r in res["rows"]}
    assert gb["w4a16-head"] < 0.8 * gb["w4a16"]  # the int4 head reads a quarter of the bf16 one


def test_quantized_lm_head_runs_end_to_end(tiny_model_dir, tmp_path):
    """`gptq: {lm_head: true}` on a tied model: the head is quantized on the last layer's
    outputs, the canonical form is untied, the runner decodes it with the W4A16 backend and
    matches the fake-quant model, and the compressed-tensors export carries it."""
    from quantlab.pipeline import run_recipe
    from quantlab.recipe import validate_recipe

    raw = {"name": "h", "seed": 0, "device": "cpu", "model": {"id": str(tiny_model_dir)},
           "calibration": {"dataset": {"source": str(WIKI_TEST)}, "num_samples": 4, "seq_len": 32},
           "stages": [{"gptq": {"weights": {"bits": 4, "group_size": 32}, "lm_head": True}}],
           "verify": {"num_prompts": 2, "prompt_tokens": 8, "max_new_tokens": 4, "perplexity_windows": 2,
                      "seq_len": 32, "dataset": {"source": str(WIKI_TEST)}},
           "export": ["compressed-tensors"], "output": {"dir": str(tmp_path / "run")}}
    run = run_recipe(validate_recipe(raw))
    quantized = run.path / "quantized"
    assert "lm_head" in json.loads((quantized / "quant_config.json").read_text())["modules"]
    assert json.loads((quantized / "config.json").read_text())["tie_word_embeddings"] is False
    runner = load_runner(run.path)
    assert isinstance(runner.lm_head, rl.WNA16Linear)
    v = json.loads((run.path / "reports" / "report.json").read_text())["verify"]
    assert v["greedy_agreement"] == 1.0 and abs(v["perplexity"]["rel_diff_pct"]) < 1e-3
    assert (run.path / "export" / "compressed-tensors" / "config.json").is_file()


def test_lm_head_recipe_refuses_exports_that_keep_it_float():
    from quantlab.errors import UserError
    from quantlab.recipe import validate_recipe

    raw = {"name": "h", "seed": 0, "model": {"id": "m"}, "stages": [{"rtn": {"lm_head": True}}]}
    with pytest.raises(UserError, match=r"stages\[0\]\.rtn\.lm_head: export awq keeps lm_head in float"):
        validate_recipe({**raw, "export": ["compressed-tensors", "awq"]})
    assert validate_recipe({**raw, "export": ["compressed-tensors", "gptq"]}).stages[0].rtn.lm_head
    with pytest.raises(UserError, match=r"stages\[0\]\.awq\.lm_head: .*unknown key"):
        validate_recipe({**raw, "stages": [{"awq": {"lm_head": True}}]})


def _decode_bench():
    import importlib.util

    from conftest import REPO

    spec = importlib.util.spec_from_file_location("decode_bench", REPO / "benchmarks" / "decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_decode_benchmark_prompts_oom_roofline_and_prefill_profile(tmp_path, monkeypatch):
    """decode.py over prompt lengths × batches: a combination that runs out of memory is
    recorded as not reached and the run goes on; the decode rows carry the HBM roofline
    fraction; --profile-prefill groups one prefill's ops by kind; the bars are per (prompt,
    batch) and count a scheme not reached as not met."""
    bench = _decode_bench()
    real = bench.time_runner

    def time_runner(model, prompts, *a, **kw):
        if prompts.shape == (1, 12) and type(model.model.layers[0].mlp.down_proj).__name__ == "W8A8Linear":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.99 GiB")
        return real(model, prompts, *a, **kw)

    monkeypatch.setattr(bench, "time_runner", time_runner)
    bench.main(["--tiny", "--schemes", "bf16,w8a8", "--prompts", "8,12", "--batches", "1,2", "--repeats", "1",
                "--new-tokens", "3", "--hbm-tbps", "0.001", "--profile-prefill", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "decode_cpu_tiny.json").read_text())
    got = {(r["scheme"], r["prompt_len"], r["batch"]): r for r in res["rows"]}
    assert len(got) == 8 and res["hbm_tbps"] == 0.001
    oom = got[("w8a8", 12, 1)]
    assert oom["status"] == "not reached (OOM)" and oom["decode_tok_s"] is None
    for key, r in got.items():
        if key != ("w8a8", 12, 1):
            assert r["status"] == "ok" and r["prefill_tok_s"] > 0
            steps_s = r["decode_tok_s"] / r["batch"]
            kv = bench.kv_bytes(bench.qwen2_config(bench.parse(["--tiny"])), r["batch"], r["prompt_len"] + 1, 4)
            assert r["kv_gb_per_step"] == pytest.approx(kv / 1e9)
            assert r["hbm_roofline"] == pytest.approx((r["weight_gb"] + r["kv_gb_per_step"]) * 1e9 * steps_s / 0.001e12)
    bars = {(b["scheme"], b["prompt_len"], b["batch"], b["bar"]): b for b in res["bars"]}
    assert set(bars) == {("w8a8", p, 1, need) for p in (8, 12) for need in (1.0, 1.5)}
    assert bars[("w8a8", 12, 1, 1.5)]["met"] is False and bars[("w8a8", 12, 1, 1.5)]["note"] == "not reached (OOM)"
    assert bars[("w8a8", 8, 1, 1.0)]["ratio"] == pytest.approx(got[("w8a8", 8, 1)]["decode_tok_s"]
                                                              / got[("bf16", 8, 1)]["decode_tok_s"])
    profiles = {p["scheme"]: p for p in res["prefill_profiles"]}
    assert set(profiles) == {"bf16", "w8a8"} and all(p["prompt_len"] == 8 and p["batch"] == 1 for p in profiles.values())
    assert profiles["bf16"]["kinds"]["gemm"]["ms"] > 0 and profiles["bf16"]["kinds"]["act quant"]["launches"] == 0
    assert profiles["w8a8"]["kinds"]["act quant"]["launches"] > 0 and profiles["w8a8"]["kinds"]["attention"]["launches"] > 0
    md = (tmp_path / "decode_cpu_tiny.md").read_text()
    assert "| w8a8 | 1 | 12 | not reached (OOM) |" in md and "## Prefill profile: prompt 8, batch 1" in md
    assert "| w8a8 decode vs bf16 | issue | 12 | 1 | — | ≥ 1.5× | **not met** (not reached (OOM)) |" in md


def test_decode_benchmark_bars_and_hbm_table():
    """The issue's bars at the prompts and batches they name; the roofline's device table."""
    import re

    bench = _decode_bench()

    def row(scheme, p, b, prefill, decode):
        return {"scheme": scheme, "prompt_len": p, "batch": b, "prefill_tok_s": prefill, "decode_tok_s": decode}

    rows = [row("bf16", 512, 16, 100.0, 10.0), row("w8a8", 512, 16, 140.0, 12.0), row("w4a16", 512, 16, 99.0, 19.0),
            row("bf16", 256, 16, 100.0, 10.0), row("w8a8", 256, 16, 100.0, 10.0)]
    got = {(b["scheme"], b["kind"], b["prompt_len"], b["bar"]): (b["met"], round(b["ratio"], 2))
           for b in bench.bars(rows)}
    assert got == {("w8a8", "prefill", 512, 1.3): (True, 1.4), ("w4a16", "prefill", 512, 1.0): (False, 0.99),
                   ("w8a8", "decode", 512, 1.0): (True, 1.2), ("w4a16", "decode", 512, 1.0): (True, 1.9),
                   ("w4a16", "decode", 512, 1.8): (True, 1.9), ("w8a8", "decode", 256, 1.0): (True, 1.0)}
    assert [t for pattern, t in bench.HBM_TBPS if re.search(pattern, "NVIDIA H200")][0] == 4.8
    assert [t for pattern, t in bench.HBM_TBPS if re.search(pattern, "NVIDIA GH200 480GB")][0] == 4.0
    assert [t for pattern, t in bench.HBM_TBPS if re.search(pattern, "NVIDIA H100 80GB HBM3")][0] == 3.35
    # batch 64 × (2048 + 128) positions of the 7B shape: 8.0 GB of bf16 K/V, well within an H200
    assert bench.kv_bytes(bench.qwen2_config(bench.parse([])), 64, 2176, 2) == 28 * 2 * 64 * 4 * 2176 * 128 * 2

