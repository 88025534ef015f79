"""Every export format, loaded by the engine users deploy it with, scored on the same windows as
quantlab's own fake-quant evaluation of the same run. Targets: every HF-format export within 0.5 %
of fake-quant, GGUF Q8_0 within 1 % of llama.cpp's float F16 (`tests/test_export_engines.py`).

For each case a shipped SmolLM2 recipe runs through the real CLI with its exports; each export
is then scored by its engine in that engine's own environment (quantlab.toolenv):
AWQ through transformers + gptqmodel, GPTQ through `GPTQModel.load`, compressed-tensors through
transformers + compressed-tensors, GGUF through llama-cpp-python (built from PyPI).

GGUF baselines come from the float model: an F16 file and a Q8_0 file written by quantlab, and
Q4_0 and Q4_K_M files made from the F16 one by llama.cpp's own quantizer (what a user gets
without us).

    python benchmarks/export_engines.py       # writes benchmarks/results/export_engines_cpu.{json,md}
    python benchmarks/export_engines.py --windows 8 --calib-samples 8 --work /tmp/ee --out /tmp/ee/r.json   # a quick run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peers_cpu import cpu_name  # benchmarks/ is this script's directory

from quantlab.export import engine_check
from quantlab.toolenv import llama_quantize

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "wikitext-2-raw-v1"
MODEL = "smollm2-135m-instruct"
HF_TOLERANCE_PCT, Q8_TOLERANCE_PCT = 0.5, 1.0  # the targets
LLAMA_BASELINES = ("q4_0", "q4_k_m")  # llama.cpp's quantizer applied to the float F16 file


@dataclass(frozen=True)
class Case:
    id: str
    recipe: str  # recipes/<recipe>.yaml, run as shipped apart from `sets`
    sets: tuple[str, ...]
    exports: tuple[str, ...]


CASES = [
    Case("rtn-w8-per-channel", "smollm2_rtn_w8a16", (), ("gguf-q8_0",)),
    Case("awq-gptq-w4-g32-sym", "smollm2_gguf_q4_0", (), ("awq", "gptq", "compressed-tensors", "gguf-q4_0",
                                                                "gguf-q4_k_m")),
    Case("gptq-w4-g64-asym-act_order", "smollm2_gptq_w4a16", ("stages.0.gptq.weights.symmetric=false",), ("gptq",)),
    Case("smoothquant-w8a8-static", "smollm2_smoothquant_a8w8_static", (), ("compressed-tensors",)),
    Case("smoothquant-w8a8-dynamic", "smollm2_smoothquant_a8w8", (), ("compressed-tensors",)),
    Case("fp8-static-fp8-kv", "smollm2_fp8_static", (), ("compressed-tensors",)),
]


def run_case(case: Case, args: argparse.Namespace) -> Path:
    run_dir = args.work / case.id
    sets = [*case.sets, f"output.dir={run_dir}", f"evaluate.perplexity.max_windows={args.windows}",
            f"calibration.dataset.source={DATA / 'wiki.train.first1MB.raw'}",
            f"evaluate.perplexity.dataset.source={DATA / 'wiki.test.raw'}", f"export=[{','.join(case.exports)}]"]
    if args.calib_samples:
        sets.append(f"calibration.num_samples={args.calib_samples}")
    say(f"{case.id}: quantlab run {case.recipe}")
    return quantlab_run(case.recipe, run_dir, sets)


def quantlab_run(recipe: str, run_dir: Path, sets: list[str]) -> Path:
    """`python -m quantlab run recipes/<recipe>.yaml --set ...` (the sets name `run_dir`)."""
    cmd = [sys.executable, "-m", "quantlab", "run", str(REPO / "recipes" / f"{recipe}.yaml")]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if proc.returncode != 0:
        raise RuntimeError(f"{recipe}: quantlab run failed: {proc.stderr[-2000:]}")
    return run_dir


def fake_quant(run_dir: Path) -> dict[str, float]:
    report = json.loads((run_dir / "reports" / "report.json").read_text())
    return {r["model"]: r["perplexity"] for r in report["perplexity"]}


def delta_pct(value: float, ref: float) -> float:
    return round(100 * (value / ref - 1), 4)


def eval_windows(run_dir: Path):
    """The `[windows, seq_len]` ids the run's perplexity stages scored."""
    from transformers import AutoTokenizer

    from quantlab.data.sampling import tokenize_joined
    from quantlab.data.sources import load_documents
    from quantlab.eval.perplexity import windows_of
    from quantlab.recipe import load_recipe
    from quantlab.stages import QUANTIZED

    recipe = load_recipe(run_dir / "recipe.resolved.yaml")
    ppl = recipe.evaluate.perplexity
    if ppl is None:
        raise ValueError(f"{run_dir}: the recipe has no evaluate.perplexity section")
    tokenizer = AutoTokenizer.from_pretrained(run_dir / QUANTIZED)
    docs = load_documents(ppl.dataset, "evaluate.perplexity.dataset", tokenizer)
    return windows_of(tokenize_joined(docs, tokenizer), ppl.seq_len, ppl.max_windows)


def score_case(case: Case, run_dir: Path) -> list[dict[str, Any]]:
    windows = eval_windows(run_dir)
    ppl = fake_quant(run_dir)
    rows = []
    for fmt in case.exports:
        say(f"{case.id}: scoring {fmt}")
        result = engine_check.score(run_dir / "export" / fmt, windows)
        rows.append({"case": case.id, "export": fmt, **result, "fake_quant_perplexity": ppl["quantized"],
                     "float_perplexity": ppl.get("float"), "delta_vs_fake_quant_pct": delta_pct(result["perplexity"], ppl["quantized"]),
                     "bytes": export_bytes(run_dir / "export" / fmt)})
    return rows


def export_bytes(path: Path) -> int:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and p.suffix in (".gguf", ".safetensors")]
    return sum(p.stat().st_size for p in files)


def float_baselines(run_dir: Path, work: Path, qtypes: tuple[str, ...] = LLAMA_BASELINES) -> list[dict[str, Any]]:
    """The float model as F16 and Q8_0 GGUF (quantlab's writer), and llama.cpp's `qtypes` (Q4_0
    and Q4_K_M) of the F16."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantlab.export.api import export
    from quantlab.models.builtin import float_checkpoint
    from quantlab.quant.canonical import save_canonical

    canonical = work / "float" / "quantized"
    if not canonical.exists():
        ckpt = float_checkpoint(MODEL)
        save_canonical(canonical, AutoModelForCausalLM.from_pretrained(ckpt), {}, AutoTokenizer.from_pretrained(ckpt),
                       {"source_model": MODEL})
    for fmt in ("gguf-f16", "gguf-q8_0"):
        if not (work / "float" / fmt).exists():
            export(canonical, work / "float" / fmt, fmt)
    llama_quantized = {}
    for qtype in qtypes:
        path = llama_quantized[f"llama.cpp {qtype}"] = work / "float" / f"llama-quantize-{qtype}.gguf"
        if not path.exists():
            llama_quantize(next((work / "float" / "gguf-f16").glob("*.gguf")), path, qtype)
    windows = eval_windows(run_dir)
    ref = fake_quant(run_dir)["float"]
    rows = []
    for name, path in {"gguf-f16": work / "float" / "gguf-f16", "gguf-q8_0": work / "float" / "gguf-q8_0",
                       **llama_quantized}.items():
        say(f"float: scoring {name}")
        result = engine_check.score(path, windows)
        rows.append({"case": "float", "export": name, **result, "fake_quant_perplexity": None, "float_perplexity": ref,
                     "delta_vs_fake_quant_pct": None, "bytes": export_bytes(path)})
    return rows


def bars(rows: list[dict[str, Any]]) -> dict[str, Any]:
    hf = [r for r in rows if r["format"] != "gguf" and r["case"] != "float"]
    by = {(r["case"], r["export"]): r for r in rows}
    llama_float = by[("float", "gguf-f16")]["perplexity"]
    q8 = [r for r in rows if r["export"] == "gguf-q8_0"]
    awq_q4, float_q4 = by[("awq-gptq-w4-g32-sym", "gguf-q4_0")], by[("float", "llama.cpp q4_0")]
    return {
        "hf_max_abs_delta_pct": max(abs(r["delta_vs_fake_quant_pct"]) for r in hf),
        "hf_within_0.5pct": all(abs(r["delta_vs_fake_quant_pct"]) <= HF_TOLERANCE_PCT for r in hf),
        "q8_0_delta_vs_llama_cpp_f16_pct": {r["case"]: delta_pct(r["perplexity"], llama_float) for r in q8},
        "q8_0_delta_vs_quantlab_float_pct": {r["case"]: delta_pct(r["perplexity"], r["float_perplexity"]) for r in q8},
        "q8_0_within_1pct": all(abs(delta_pct(r["perplexity"], llama_float)) <= Q8_TOLERANCE_PCT for r in q8),
        "q4_0_awq_vs_float": [awq_q4["perplexity"], float_q4["perplexity"]],
        "q4_0_bytes_awq_vs_float": [awq_q4["bytes"], float_q4["bytes"]],
        "q4_0_awq_beats_float": awq_q4["perplexity"] < float_q4["perplexity"],
        **k_quant_comparison(by),
    }


def k_quant_comparison(by: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    """llama.cpp's Q4_K_M of the AWQ+GPTQ weights against its Q4_K_M of the float model."""
    ours, theirs = by.get(("awq-gptq-w4-g32-sym", "gguf-q4_k_m")), by.get(("float", "llama.cpp q4_k_m"))
    if not (ours and theirs):
        return {}
    return {"q4_k_m_awq_vs_float": [ours["perplexity"], theirs["perplexity"]],
            "q4_k_m_bytes_awq_vs_float": [ours["bytes"], theirs["bytes"]]}


def markdown(payload: dict[str, Any]) -> str:
    lines = [f"# Exports scored by their engines — SmolLM2-135M-Instruct, {payload['windows']} × 512 windows of "
             "wiki.test.raw", "", f"CPU: {payload['machine']['cpu']}. Command: `{payload['command']}`", "",
             "| case | export | engine (layer class) | engine ppl | quantlab fake-quant ppl | Δ | float ppl | MB |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in payload["rows"]:
        fq = f"{r['fake_quant_perplexity']:.4f}" if r["fake_quant_perplexity"] else "—"
        delta = f"{r['delta_vs_fake_quant_pct']:+.2f} %" if r["delta_vs_fake_quant_pct"] is not None else "—"
        engine = r["engine"] + (f" ({r['linear_class']})" if r.get("linear_class") else "")
        lines.append(f"| {r['case']} | {r['export']} | {engine} | {r['perplexity']:.4f} | {fq} | {delta} | "
                     f"{r['float_perplexity']:.4f} | {r['bytes'] / 2**20:.1f} |")
    lines += ["", "Bars: `" + json.dumps(payload["bars"]) + "`", ""]
    return "\n".join(lines)


def say(text: str) -> None:
    print(f"[export_engines {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--windows", type=int, default=40, help="wiki.test.raw windows of 512 tokens (default 40)")
    p.add_argument("--calib-samples", type=int, default=None, help="override every recipe's calibration.num_samples")
    p.add_argument("--only", default=None, help="comma-separated case ids (default: all; the float rows always run); "
                   "their rows replace those in an existing --out")
    p.add_argument("--work", type=Path, default=Path("runs/export_engines"))
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "export_engines_cpu.json",
                   help="JSON path (a .md is written beside it)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cases = [c for c in CASES if not args.only or c.id in args.only.split(",")]
    rows: list[dict[str, Any]] = []
    first_run = None
    for case in cases:
        run_dir = run_case(case, args)
        first_run = first_run or run_dir
        rows += score_case(case, run_dir)
    assert first_run is not None, "no case selected"
    rows += float_baselines(first_run, args.work)
    out = args.out
    command = " ".join(["python", "benchmarks/export_engines.py", *(argv or sys.argv[1:])])
    if args.only and out.is_file():  # replace the selected cases' rows (and the float rows) in the saved table
        saved = json.loads(out.read_text())
        done = {r["case"] for r in rows}
        rows = [r for r in saved["rows"] if r["case"] not in done] + rows
        command = f"{saved['command']} && {command}"
        rows.sort(key=lambda r: [c.id for c in CASES].index(r["case"]) if r["case"] != "float" else len(CASES))
    complete = {"rtn-w8-per-channel", "awq-gptq-w4-g32-sym"} <= {r["case"] for r in rows}  # what bars() reads
    payload = {"windows": args.windows, "calib_samples": args.calib_samples,
               "command": command,
               "machine": {"cpu": cpu_name(), "cores": os.cpu_count()},
               "rows": rows, "bars": bars(rows) if complete else None}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    if payload["bars"]:
        out.with_suffix(".md").write_text(markdown(payload))
        print(markdown(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
