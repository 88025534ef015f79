"""The bundled runner against the fake-quant model on real SmolLM2 runs: perplexity within 0.5 %
and greedy agreement of at least 99 % (the targets; `tests/test_verify_smollm2.py` checks them at
a small size).

Each case runs a shipped recipe through the real CLI with a `verify:` section: 16 prompts cut
from wiki.test.raw, 64 greedy tokens each, the runner's perplexity next to the fake-quant
model's on the same windows (`quantlab.runner.verify`). Cases: W4A16 AWQ, W4A16 GPTQ with
act_order, W8A8 SmoothQuant (dynamic per-token), FP8 weights and activations with an int8
(C8) KV cache. `--device cuda` runs the same on a GPU (the runner then uses its Triton
kernels and CUDA graphs; the fake-quant reference runs in float32).

    python benchmarks/verify_runner.py --device cpu
    python benchmarks/verify_runner.py --device cpu --precision float64 --only w8a8-smoothquant,fp8-int8-kv
    python benchmarks/verify_runner.py --device cuda --dtype float16 --model /path/SmolLM2.gguf --data DIR

Writes `benchmarks/results/verify_runner_<device>.json` and `.md` (`cpu`, or the GPU's name as
`nvidia_h200`), unless `--out` says otherwise: one file per device, each configuration (verify
precision, dtype) a part of it that the next run of that configuration replaces.
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

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "wikitext-2-raw-v1"
PPL_TOLERANCE_PCT, AGREEMENT_BAR = 0.5, 0.99


@dataclass(frozen=True)
class Case:
    id: str
    recipe: str
    sets: tuple[str, ...] = ()


CASES = [
    Case("w4a16-awq", "smollm2_awq_w4a16"),
    Case("w4a16-gptq-act_order", "smollm2_gptq_w4a16"),
    Case("w8a8-smoothquant", "smollm2_smoothquant_a8w8"),
    Case("fp8-int8-kv", "smollm2_fp8", ("stages.1.act_ranges.kv_cache.type=int",)),
]


def run_case(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    run_dir = args.work / f"{case.id}-{args.device}"
    sets = [*case.sets, f"device={args.device}", f"output.dir={run_dir}",
            f"calibration.dataset.source={args.data / 'wiki.train.first1MB.raw'}",
            f"evaluate.perplexity.dataset.source={args.data / 'wiki.test.raw'}",
            f"evaluate.perplexity.max_windows={args.windows}", f"verify.num_prompts={args.prompts}",
            f"verify.max_new_tokens={args.new_tokens}", f"verify.perplexity_windows={args.windows}"]
    if args.calib_samples:
        sets.append(f"calibration.num_samples={args.calib_samples}")
    if args.model:
        sets.append(f"model.id={args.model}")
    if args.dtype:
        sets.append(f"model.dtype={args.dtype}")
    if args.precision:
        sets.append(f"verify.precision={args.precision}")
    cmd = [sys.executable, "-m", "quantlab", "run", str(REPO / "recipes" / f"{case.recipe}.yaml")]
    for s in sets:
        cmd += ["--set", s]
    print(f"[verify_runner {time.strftime('%H:%M:%S')}] {case.id} on {args.device}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if proc.returncode != 0:
        raise RuntimeError(f"{case.id}: quantlab run failed: {proc.stderr[-3000:]}")
    verify = json.loads((run_dir / "reports" / "verify.json").read_text())
    return {"case": case.id, "recipe": case.recipe, "sets": list(case.sets), "seconds": round(time.perf_counter() - start, 1),
            **summary(verify)}


def summary(verify: dict[str, Any]) -> dict[str, Any]:
    """The bar's numbers out of a verify report (kept whole under `verify`)."""
    ppl = verify.get("perplexity") or {}
    runner, fq = (ppl.get(k, {}).get("perplexity") for k in ("runner", "fake_quant"))
    delta = round(100 * (runner / fq - 1), 4) if runner and fq else None
    agreement = verify.get("greedy_agreement")
    return {"runner_perplexity": runner, "fake_quant_perplexity": fq, "perplexity_delta_pct": delta,
            "greedy_agreement": agreement,
            "floor_agreement": (verify.get("reference_floor") or {}).get("greedy_agreement"),
            "meets_bar": delta is not None and abs(delta) <= PPL_TOLERANCE_PCT and agreement is not None
            and agreement >= AGREEMENT_BAR, "verify": verify}


def markdown(payload: dict[str, Any]) -> str:
    lines = [f"# Runner vs fake-quant on real SmolLM2 runs — {payload['device_name']}", "",
             f"{payload['prompts']} prompts × {payload['new_tokens']} greedy tokens; perplexity on "
             f"{payload['windows']} × 512 windows of wiki.test.raw; "
             f"dtype {payload['dtype']}, verify precision {payload.get('precision', 'model')}. "
             f"Command: `{payload['command']}`", "",
             "Floor: the fake-quant model's agreement with its own float64 copy at the same positions "
             "(how far rounding alone moves a scheme's argmax).", "",
             "| case | runner ppl | fake-quant ppl | Δ | greedy agreement | floor | bar (≤ 0.5 %, ≥ 99 %) |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in payload["rows"]:
        lines.append(f"| {r['case']} | {r['runner_perplexity']:.4f} | {r['fake_quant_perplexity']:.4f} | "
                     f"{r['perplexity_delta_pct']:+.3f} % | {100 * r['greedy_agreement']:.2f} % | "
                     f"{_pct(r.get('floor_agreement'))} | {'met' if r['meets_bar'] else 'NOT met'} |")
    return "\n".join(lines) + "\n"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.2f} %"


def device_name(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name()
    from peers_cpu import cpu_name  # benchmarks/ is this script's directory

    return cpu_name()


def result_name(payload: dict[str, Any]) -> str:
    """`cpu`, or the GPU's name as a slug (`nvidia_h200`)."""
    from peers_cpu import device_slug

    return "cpu" if payload["device"] == "cpu" else device_slug(payload["device_name"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model", default=None, help="model.id override (e.g. a local .gguf on a machine without the cache)")
    p.add_argument("--dtype", default=None, help="model.dtype override: bfloat16 runs the GPU kernels (float32 "
                   "takes the kernels' torch reference path)")
    p.add_argument("--precision", choices=["model", "float64"], default=None,
                   help="verify.precision: float64 compares both models in float64 on the CPU")
    p.add_argument("--data", type=Path, default=DATA, help="directory with wiki.train.first1MB.raw and wiki.test.raw")
    p.add_argument("--windows", type=int, default=8, help="perplexity windows of 512 (evaluation and verify)")
    p.add_argument("--prompts", type=int, default=16, help="verify prompts (default 16)")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt (default 64)")
    p.add_argument("--calib-samples", type=int, default=None, help="override every recipe's calibration.num_samples")
    p.add_argument("--only", default=None, help="comma-separated case ids")
    p.add_argument("--work", type=Path, default=Path("runs/verify_runner"))
    p.add_argument("--out", type=Path, default=None, help="JSON path (a .md is written beside it; default "
                   "benchmarks/results/verify_runner_<device>.json)")
    args = p.parse_args(argv)
    rows = [run_case(c, args) for c in CASES if not args.only or c.id in args.only.split(",")]
    payload = {"device": args.device, "device_name": device_name(args.device), "windows": args.windows,
               "prompts": args.prompts, "new_tokens": args.new_tokens, "calib_samples": args.calib_samples,
               "dtype": args.dtype or "recipe default", "precision": args.precision or "model",
               "command": " ".join(["python", "benchmarks/verify_runner.py", *(argv or sys.argv[1:])]), "rows": rows}
    out = args.out or REPO / "benchmarks" / "results" / f"verify_runner_{result_name(payload)}.json"
    save(payload, out)
    print(markdown(payload))
    return 0


def save(payload: dict[str, Any], out: Path) -> None:
    """One result file per device: each configuration (verify precision, dtype) is a part that
    a new run of the same configuration replaces."""
    parts = []
    if out.is_file():
        saved = json.loads(out.read_text())
        parts = saved.get("parts", [saved])
    same = lambda p: (p.get("precision", "model"), p["dtype"]) == (payload["precision"], payload["dtype"])  # noqa: E731
    parts = [p for p in parts if not same(p)] + [payload]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"parts": parts}, indent=2) + "\n")
    out.with_suffix(".md").write_text("\n".join(markdown(p) for p in parts))


if __name__ == "__main__":
    sys.exit(main())
