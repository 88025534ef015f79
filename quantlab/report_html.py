"""Reports as one self-contained HTML file: tables, matplotlib plots embedded as PNG data URIs,
no script, stylesheet or font fetched from anywhere, so the page opens offline and can be
mailed or attached to a model card as it is.

`run_page(report, samples)` renders one run's report.json (with a few generated summaries
beside their references); `compare_page(rows)` the table of `quantlab compare`.
"""

from __future__ import annotations

import base64
import html
import io
from typing import Any, Sequence

from quantlab.report import ROUGE_NAMES

STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2em auto;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}
th{background:#f4f4f4}td.text,th.text{text-align:left;vertical-align:top;max-width:340px}
img{max-width:100%}figure{margin:1em 0}.note{color:#666;font-size:90%}
"""


def _figure(draw: Any, width: float = 8, height: float = 3.2) -> str:
    """An <img> holding what `draw(ax)` plots, as an embedded PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(width, height), dpi=110)
    try:
        draw(ax)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
    finally:
        plt.close(fig)
    return f'<img alt="plot" src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], text_cols: Sequence[int] = (0,)) -> str:
    def cell(tag: str, i: int, v: Any) -> str:
        cls = ' class="text"' if i in text_cols else ""
        return f"<{tag}{cls}>{html.escape('' if v is None else str(v))}</{tag}>"

    head = "".join(cell("th", i, h) for i, h in enumerate(header)) if any(header) else ""
    body = "".join("<tr>" + "".join(cell("td", i, v) for i, v in enumerate(r)) + "</tr>" for r in rows)
    return f"<table>{f'<tr>{head}</tr>' if head else ''}{body}</table>"


def _page(title: str, sections: list[str]) -> str:
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>{''.join(sections)}</body></html>\n")


def _summary(r: dict[str, Any]) -> str:
    size = f"{r['size_bytes'] / 1e6:.1f} MB" if r.get("size_bytes") else "—"
    rows = [("model", r["model"]), ("stages", " → ".join(r["stages"])),
            ("scheme", f"{r['scheme']} ({r['quantized_linears']} Linears)"),
            ("quantization time", f"{r['quantize_seconds']} s"), ("quantized model on disk", size)]
    return "<h2>Summary</h2>" + _table(("", ""), rows, text_cols=(0, 1))


def _perplexity(r: dict[str, Any]) -> str:
    ppl = r.get("perplexity") or []
    if not ppl:
        return ""
    rows = [(p["model"], f"{p['perplexity']:.4f}",
             "—" if p.get("delta_vs_float_pct") is None else f"{p['delta_vs_float_pct']:+.2f}%", p["windows"],
             p["tokens_scored"]) for p in ppl]
    out = f"<h2>Perplexity — {html.escape(str(ppl[0]['dataset']))}</h2>"
    out += _table(("model", "perplexity", "Δ vs float", "windows", "tokens"), rows)
    d = r.get("divergence")
    if d:
        out += "<h3>Divergence from float</h3>" + _table(
            ("KL mean", "KL p99", "KL max", "top-1 agreement", "tokens"),
            [(f"{d['mean_kld']:.5f}", f"{d['p99_kld']:.5f}", f"{d['max_kld']:.4f}",
              f"{100 * d['top1_agreement']:.2f}%", d["tokens_scored"])], text_cols=())
    return out


def _rouge(r: dict[str, Any], samples: Sequence[dict[str, Any]]) -> str:
    rouge = r.get("rouge")
    if not rouge:
        return ""
    q, f, diff = rouge["quantized"], rouge.get("float"), rouge.get("difference")
    rows = [(m["model"], *(f"{m[k]:.2f}" for k in ROUGE_NAMES), f"{m['samples_per_s']:.3f}")
            for m in (f, q) if m]
    if diff:
        rows.append(("Δ quantized − float", *(f"{diff[k]['mean']:+.2f} [{diff[k]['ci95'][0]:+.2f}, "
                                               f"{diff[k]['ci95'][1]:+.2f}]" for k in ROUGE_NAMES), ""))
    out = (f"<h2>ROUGE — {html.escape(str(q['dataset']))}</h2><p class=\"note\">{q['samples']} samples, "
           f"{q['prompt']} prompt, greedy, scored by {q['tokenize']}; F-measure in points; Δ with its paired "
           "bootstrap 95% interval.</p>")
    out += _table(("model", *ROUGE_NAMES.values(), "samples/s"), rows)
    if diff:
        def draw(ax: Any) -> None:
            names = list(ROUGE_NAMES)
            means = [diff[k]["mean"] for k in names]
            lo = [diff[k]["mean"] - diff[k]["ci95"][0] for k in names]
            hi = [diff[k]["ci95"][1] - diff[k]["mean"] for k in names]
            ax.errorbar(range(len(names)), means, yerr=[lo, hi], fmt="o", capsize=6)
            ax.axhline(0, color="#888", lw=1)
            ax.set_xticks(range(len(names)), list(ROUGE_NAMES.values()))
            ax.set_ylabel("quantized − float (points)")
            ax.set_title("ROUGE difference with 95% interval")
        out += f"<figure>{_figure(draw, 7, 3)}</figure>"
    if samples:
        out += "<h3>Summaries side by side</h3>" + _table(
            ("reference", "float", "quantized"),
            [(s["reference"], s.get("float", "—"), s["quantized"]) for s in samples], text_cols=(0, 1, 2))
    return out


def _layers(r: dict[str, Any]) -> str:
    errors = r.get("linear_errors")
    if not errors or not errors.get("layers"):
        return ""

    def draw(ax: Any) -> None:
        layers = errors["layers"]
        x = [e["layer"] for e in layers]
        for key, label in (("rtn", "round-to-nearest"), ("quantized", "as quantized")):
            ax.plot(x, [float("nan") if e[key] is None else e[key] for e in layers], marker=".", label=label)
        ax.set_xlabel("decoder layer")
        ax.set_ylabel("relative output error")
        ax.set_title("Mean Linear output error per layer (calibration tokens)")
        ax.legend()

    return f"<h2>Per-layer quantization error</h2><figure>{_figure(draw)}</figure>"


def _experts(r: dict[str, Any]) -> str:
    """Tokens routed to each expert of each MoE layer as a heat map; experts none reached, and
    what the stages did for them."""
    c = r.get("expert_coverage")
    if not c or not c.get("layers"):
        return ""

    def draw(ax: Any) -> None:
        image = ax.imshow([row["tokens"] for row in c["layers"]], aspect="auto", cmap="viridis")
        ax.set_xlabel("expert")
        ax.set_ylabel("MoE layer")
        ax.set_title("Calibration tokens routed to each expert")
        ax.figure.colorbar(image, ax=ax)

    text = (f"{c['experts_unreached']} of {c['experts']} experts got no routed calibration token"
            + ("; every expert's statistics saw every token (calibration.all_experts)." if c["all_experts"] else "."))
    fallbacks = "".join(f"<li>{html.escape(k)}: {html.escape(v)}</li>" for k, v in c["fallbacks"].items())
    return (f"<h2>Expert coverage</h2><p>{html.escape(text)}</p>"
            + (f"<ul>{fallbacks}</ul>" if fallbacks else "") + f"<figure>{_figure(draw)}</figure>")


def _stage_times(r: dict[str, Any]) -> str:
    times = {k: v for k, v in (r.get("stage_seconds") or {}).items() if v is not None}
    if not times:
        return ""

    def draw(ax: Any) -> None:
        names = list(times)
        ax.barh(range(len(names)), [times[n] for n in names])
        ax.set_yticks(range(len(names)), names)
        ax.invert_yaxis()
        ax.set_xlabel("seconds")
        ax.set_title("Time per stage (last run of each)")

    return f"<h2>Stage times</h2><figure>{_figure(draw, 7, 0.5 + 0.35 * len(times))}</figure>"


def run_page(report: dict[str, Any], samples: Sequence[dict[str, Any]] = ()) -> str:
    """One run's report; `samples`: `{reference, float, quantized}` summaries to show."""
    sections = [_summary(report), _perplexity(report), _rouge(report, samples), _layers(report),
                _experts(report), _stage_times(report)]
    versions = ", ".join(f"{k} {v}" for k, v in report.get("versions", {}).items())
    sections.append(f"<p class=\"note\">{html.escape(versions)}</p>")
    return _page(f"quantlab report — {report['recipe']}", sections)


COMPARE_COLUMNS = ("run", "stages", "scheme", "size MB", "quantize s", "perplexity", "Δ ppl", "KL mean",
                   "top-1", "ROUGE-1", "Δ ROUGE-1")


def compare_page(rows: Sequence[dict[str, Any]]) -> str:
    """`quantlab compare`'s table and a plot of perplexity and KL divergence per run."""
    table = _table(COMPARE_COLUMNS, [[row.get(c, "") for c in COMPARE_COLUMNS] for row in rows], text_cols=(0, 1, 2))
    scored = [r for r in rows if isinstance(r.get("perplexity"), (int, float))]
    figure = ""
    if scored:
        def draw(ax: Any) -> None:
            names = [r["run"] for r in scored]
            ax.bar(range(len(names)), [r["perplexity"] for r in scored])
            ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
            ax.set_ylabel("perplexity")
            kld = [r.get("KL mean") for r in scored]
            if all(isinstance(k, (int, float)) for k in kld):
                twin = ax.twinx()
                twin.plot(range(len(names)), kld, "o-", color="C1")
                twin.set_ylabel("KL(float ‖ quantized) mean", color="C1")
            ax.set_title("Perplexity (bars) and KL divergence (line) per run")
        figure = f"<figure>{_figure(draw, 8, 3.6)}</figure>"
    return _page("quantlab compare", [table, figure])
