"""Shipped recipes of one model side by side, through the CLI: perplexity, KL divergence, top-1
agreement, quantization time and size, and the bundled runner's verification of each.

    python benchmarks/recipe_table.py gemma3 [--root runs/bench-recipes] [--also RECIPE:KEY=VALUE ...]

Every recipe `recipes/<prefix>_*.yaml` runs as `quantlab run` into `<root>/<prefix>/<recipe>`:
the runs are siblings, so the float model is evaluated once and later runs reuse it, and a
finished run resumes without recomputing. The table is `quantlab compare` of the runs plus the
verification columns (greedy agreement and logit error of the runner against the fake-quant
model, their perplexity difference) and each `quantlab run`'s wall time (a resumed run: near 0).
`--also gemma3_awq_w4a16:stages.0.awq.objective=block` adds a row: that recipe with one override.

Writes `benchmarks/results/recipes_<prefix>_cpu.{json,md}` (or `--out`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def run(recipe: Path, run_dir: Path, sets: list[str]) -> dict[str, Any]:
    start = time.perf_counter()
    args = [sys.executable, "-m", "quantlab", "run", str(recipe), "--set", f"output.dir={run_dir}"]
    for s in sets:
        args += ["--set", s]
    subprocess.run(args, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return {"wall_s": round(time.perf_counter() - start, 1)}


def row(run_dir: Path, timing: dict[str, Any]) -> dict[str, Any]:
    from quantlab.compare import compare_row

    report = json.loads((run_dir / "reports" / "report.json").read_text())
    verify = report.get("verify") or {}
    return {**compare_row(run_dir), **timing,
            "runner greedy agreement": verify.get("greedy_agreement"),
            "runner logit rel error": verify.get("logits", {}).get("rel"),
            "runner Δ ppl %": round(verify["perplexity"]["rel_diff_pct"], 4) if verify.get("perplexity") else None}


def markdown(prefix: str, rows: list[dict[str, Any]], command: str) -> str:
    columns = list(rows[0])
    lines = [f"# Shipped {prefix} recipes on CPU", "", f"`{command}`", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join("—" if r[c] is None else str(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("prefix", help="recipes/<prefix>_*.yaml")
    p.add_argument("--root", type=Path, default=REPO / "runs" / "bench-recipes")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--also", action="append", default=[], help="RECIPE:KEY=VALUE, a shipped recipe with one override")
    args = p.parse_args()
    cases = [(path, path.stem, []) for path in sorted((REPO / "recipes").glob(f"{args.prefix}_*.yaml"))]
    for extra in args.also:
        stem, _, override = extra.partition(":")
        cases.append((REPO / "recipes" / f"{stem}.yaml", f"{stem}+{override}", [override]))
    rows = []
    for recipe, name, sets in cases:
        run_dir = args.root / args.prefix / name
        rows.append(row(run_dir, run(recipe, run_dir, sets)))
        print(json.dumps(rows[-1]), flush=True)
    out = args.out or REPO / "benchmarks" / "results" / f"recipes_{args.prefix}_cpu"
    command = " ".join(["python benchmarks/recipe_table.py", args.prefix, *(f"--also {a}" for a in args.also)])
    out.with_suffix(".json").write_text(json.dumps({"command": command, "rows": rows}, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(args.prefix, rows, command))


if __name__ == "__main__":
    main()
