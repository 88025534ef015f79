"""`quantlab compare`: one row per finished run, read from its reports/report.json — method,
scheme, size on disk, quantization time, perplexity, KL divergence and ROUGE — as a table for
the terminal, Markdown, or an HTML page with a plot (`quantlab.report_html.compare_page`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from quantlab.errors import UserError
from quantlab.report_html import COMPARE_COLUMNS


def compare_row(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "reports" / "report.json"
    if not path.is_file():
        raise UserError(f"{run_dir}: no reports/report.json; give run directories that quantlab run finished")
    try:
        r = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        raise UserError(f"{path}: not valid JSON; run quantlab eval {run_dir} to write it again") from None
    ppl = {p["model"]: p for p in r.get("perplexity") or []}
    quant = ppl.get("quantized", {})
    kld, rouge = r.get("divergence") or {}, r.get("rouge") or {}
    rouge1 = rouge.get("quantized", {}).get("rouge1")
    diff = rouge.get("difference", {}).get("rouge1")
    return {
        "run": run_dir.name, "stages": " → ".join(r.get("stages", [])), "scheme": r.get("scheme"),
        "size MB": round(r["size_bytes"] / 1e6, 1) if r.get("size_bytes") else None,
        "quantize s": r.get("quantize_seconds"),
        "perplexity": round(quant["perplexity"], 4) if quant else None,
        "Δ ppl": f"{quant['delta_vs_float_pct']:+.2f}%" if quant.get("delta_vs_float_pct") is not None else None,
        "KL mean": round(kld["mean_kld"], 5) if kld else None,
        "top-1": f"{100 * kld['top1_agreement']:.2f}%" if kld else None,
        "ROUGE-1": rouge1,
        "Δ ROUGE-1": f"{diff['mean']:+.2f} [{diff['ci95'][0]:+.2f}, {diff['ci95'][1]:+.2f}]" if diff else None,
    }


def compare_rows(run_dirs: Sequence[Path]) -> list[dict[str, Any]]:
    return [compare_row(Path(d)) for d in run_dirs]


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    cell = lambda v: "—" if v is None else str(v)  # noqa: E731
    lines = ["| " + " | ".join(COMPARE_COLUMNS) + " |", "|" + "---|" * 3 + "---:|" * (len(COMPARE_COLUMNS) - 3)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in COMPARE_COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"
