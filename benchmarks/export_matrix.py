"""Every shipped recipe × every export format: refused at validation (with the exporter's reason),
or exported, loaded by its real engine and scored against the run's own fake-quant perplexity on
the same windows. Target: every allowed cell within 0.5 %.

Each recipe runs on SmolLM2-135M-Instruct (the Qwen2 recipes too: `model.id` is overridden) at
small settings (`--calib-samples` calibration samples, `--windows` evaluation windows of 512
tokens, no float baseline); what is compared is the run's fake-quant model against its export,
whatever the calibration's quality. Which formats a recipe allows comes from
`quantlab.admission.allowed_formats`, the check `quantlab validate` runs; each allowed format is
then exported with `quantlab.export.api.export` (which validates it) and scored by its engine in
that engine's own environment (quantlab.export.engine_check): AWQ through transformers +
gptqmodel, GPTQ through `GPTQModel.load`, compressed-tensors through transformers +
compressed-tensors, GGUF through llama-cpp-python. TensorRT-LLM and PaddleNLP have no engine
on a CPU machine: their cells are validated and decoded back by quantlab's reader only.

    python benchmarks/export_matrix.py     # writes benchmarks/results/export_matrix_cpu.{json,md}
    python benchmarks/export_matrix.py --only smollm2_rtn_w4a16 --work /tmp/em --out /tmp/em/r.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from export_engines import DATA, MODEL, delta_pct, eval_windows, export_bytes, fake_quant, quantlab_run
from peers_cpu import cpu_name

from quantlab.admission import allowed_formats, model_config
from quantlab.errors import UserError
from quantlab.export import api, engine_check
from quantlab.formats import FORMATS, family_of
from quantlab.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
TOLERANCE_PCT = 0.5


def recipes() -> list[str]:
    return sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))


def run_recipe(name: str, args: argparse.Namespace) -> Path:
    run_dir = args.work / name
    sets = [f"model.id={MODEL}", f"output.dir={run_dir}", f"evaluate.perplexity.max_windows={args.windows}",
            "evaluate.perplexity.baseline=false", f"calibration.num_samples={args.calib_samples}",
            f"calibration.dataset.source={DATA / 'wiki.train.first1MB.raw'}",
            f"evaluate.perplexity.dataset.source={DATA / 'wiki.test.raw'}"]
    say(f"{name}: quantlab run")
    return quantlab_run(name, run_dir, sets)


def cells(name: str, run_dir: Path) -> list[dict[str, Any]]:
    recipe = load_recipe(run_dir / "recipe.resolved.yaml")
    located = model_config(recipe)
    assert located is not None, name
    refusals = allowed_formats(recipe, *located)
    windows, ppl = eval_windows(run_dir), fake_quant(run_dir)["quantized"]
    rows = []
    for fmt in FORMATS:
        row: dict[str, Any] = {"recipe": name, "export": fmt, "fake_quant_perplexity": ppl}
        if refusals[fmt]:
            rows.append({**row, "status": "refused", "reason": refusals[fmt]})
            continue
        out = run_dir / "export" / fmt
        try:
            if not out.exists():
                api.export(run_dir / "quantized", out, fmt)
        except UserError as exc:  # admission let through what the exporter refuses: a bug this table shows
            rows.append({**row, "status": "refused at export", "reason": str(exc)})
            continue
        if family_of(fmt) not in engine_check.ENGINES:
            rows.append({**row, "status": "validated", "engine": None, "bytes": export_bytes(out)})
            continue
        say(f"{name}: scoring {fmt}")
        result = score(out, windows, fmt)
        delta = delta_pct(result["perplexity"], ppl)
        rows.append({**row, **result, "status": "ok" if abs(delta) <= TOLERANCE_PCT else "off",
                     "delta_vs_fake_quant_pct": delta, "bytes": export_bytes(out)})
    return rows


def score(out: Path, windows: Any, fmt: str) -> dict[str, Any]:
    """The engine's score; GPTQ falls back to gptqmodel's plain torch kernel where its default CPU
    kernel (aten int4pack) refuses a group size that does not divide the inputs, as a user would."""
    try:
        return engine_check.score(out, windows)
    except RuntimeError as exc:
        if fmt != "gptq":
            raise
        failure = str(exc).strip().splitlines()[-1]
        return {**engine_check.score(out, windows, backend="GPTQ_TORCH"), "backend": "GPTQ_TORCH",
                "default_backend_failure": failure}


def cell_text(row: dict[str, Any]) -> str:
    if row["status"] in ("refused", "refused at export"):
        return row["status"]
    if row["status"] == "validated":
        return "validated, no engine"
    mark = "" if row["status"] == "ok" else " ✗"
    return f"{row['delta_vs_fake_quant_pct']:+.2f} %{mark}" + (" ᵀ" if row.get("backend") else "")


def markdown(payload: dict[str, Any]) -> str:
    rows = payload["rows"]
    names = list(dict.fromkeys(r["recipe"] for r in rows))
    by = {(r["recipe"], r["export"]): r for r in rows}
    lines = [f"# Export matrix — shipped recipes on SmolLM2-135M-Instruct, {payload['windows']} × 512 windows of "
             "wiki.test.raw", "",
             f"CPU: {payload['machine']['cpu']}. Command: `{payload['command']}`", "",
             "Cell: engine perplexity vs the run's fake-quant perplexity (Δ), `refused` at validation (reason "
             "below), or `validated, no engine` (TensorRT-LLM / PaddleNLP: no CPU engine). ᵀ: gptqmodel's "
             "default CPU kernel refused the export (reason below); scored with its GPTQ_TORCH kernel.", "",
             "| recipe | fake-quant ppl | " + " | ".join(FORMATS) + " |",
             "|---|---:|" + "---:|" * len(FORMATS)]
    for name in names:
        ppl = next(r["fake_quant_perplexity"] for r in rows if r["recipe"] == name)
        lines.append(f"| {name} | {ppl:.3f} | " + " | ".join(cell_text(by[(name, f)]) for f in FORMATS) + " |")
    lines += ["", "## Reasons", ""]
    for r in rows:
        if "reason" in r:
            lines.append(f"- {r['recipe']} × {r['export']}: {r['reason']}")
        if "default_backend_failure" in r:
            lines.append(f"- {r['recipe']} × {r['export']} ᵀ: gptqmodel AUTO: {r['default_backend_failure']}")
    lines += ["", "Summary: `" + json.dumps(payload["summary"]) + "`", ""]
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    scored = [r for r in rows if "delta_vs_fake_quant_pct" in r]
    return {"cells": len(rows), "refused": sum(r["status"] == "refused" for r in rows),
            "scored": len(scored), "validated_without_engine": sum(r["status"] == "validated" for r in rows),
            "refused_at_export": sum(r["status"] == "refused at export" for r in rows),
            "max_abs_delta_pct": max((abs(r["delta_vs_fake_quant_pct"]) for r in scored), default=None),
            "all_scored_within_0.5pct": all(r["status"] == "ok" for r in scored)}


def say(text: str) -> None:
    print(f"[export_matrix {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--windows", type=int, default=8, help="wiki.test.raw windows of 512 tokens (default 8)")
    p.add_argument("--calib-samples", type=int, default=4, help="calibration samples per recipe (default 4)")
    p.add_argument("--only", default=None, help="comma-separated recipe names (default: every shipped recipe)")
    p.add_argument("--work", type=Path, default=Path("runs/export_matrix"))
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "export_matrix_cpu.json",
                   help="JSON path (a .md is written beside it)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows: list[dict[str, Any]] = []
    for name in [n for n in recipes() if not args.only or n in args.only.split(",")]:
        rows += cells(name, run_recipe(name, args))
    payload = {"windows": args.windows, "calib_samples": args.calib_samples,
               "command": " ".join(["python", "benchmarks/export_matrix.py", *(argv or sys.argv[1:])]),
               "machine": {"cpu": cpu_name(), "cores": os.cpu_count()}, "rows": rows, "summary": summary(rows)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(payload))
    print(markdown(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
