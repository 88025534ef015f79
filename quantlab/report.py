"""The run report: JSON for machines, Markdown and one self-contained HTML page for people
(`quantlab.report_html`)."""

from __future__ import annotations

import json
from typing import Any

from quantlab.recipe import Recipe
from quantlab.rundir import RunDir, write_text_atomic


def scheme_summary(quant_config: dict[str, Any]) -> str:
    schemes = sorted({_weight_summary(m) for m in quant_config["modules"].values()})
    acts, kv = quant_config.get("activations"), quant_config.get("kv_cache")
    if acts:
        how = "dynamic" if acts["dynamic"] else f"static ({acts['observer']})"
        schemes.append(f"A8 {'int8' if acts['type'] == 'int' else 'FP8'} per-{acts['granularity']} {how}")
    if kv:
        schemes.append(f"KV {'int8' if kv['type'] == 'int' else 'FP8'} per-{kv['granularity']}")
    return ", ".join(schemes) or "none"


def _weight_summary(m: dict[str, Any]) -> str:
    if m.get("per_tensor") or m.get("type") == "float":
        return f"{'FP8' if m.get('type') == 'float' else 'W' + str(m['bits'])} per-{'tensor' if m.get('per_tensor') else 'channel'}"
    return (f"W{m['bits']}{'' if m['symmetric'] else ' asym'} "
            f"{'per-channel' if m['group_size'] is None else 'g' + str(m['group_size'])}")


def write_report(
    run: RunDir, recipe: Recipe, results: list[dict[str, Any]], quant_config: dict[str, Any],
    json_path: str, md_path: str, verify: dict[str, Any] | None = None,
    divergence: dict[str, Any] | None = None, rouge: dict[str, Any] | None = None,
    linear_errors: dict[str, Any] | None = None, size_bytes: int | None = None,
    expert_coverage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    float_ppl = next((r["perplexity"] for r in results if r["model"] == "float"), None)
    for r in results:
        r["delta_vs_float_pct"] = None if float_ppl is None else round(100 * (r["perplexity"] / float_ppl - 1), 3)
    payload = {
        "recipe": recipe.name,
        "model": recipe.model.id,
        "stages": [e.kind for e in recipe.stages],
        "scheme": scheme_summary(quant_config),
        "quantized_linears": len(quant_config["modules"]),
        "quantize_seconds": quant_config.get("quantize_seconds"),
        "size_bytes": size_bytes,
        "stage_seconds": {name: s.get("seconds") for name, s in run.manifest.get("stages", {}).items()},
        "perplexity": results,
        "versions": run.manifest.get("versions", {}),
    }
    if divergence is not None:
        payload["divergence"] = divergence
    if rouge is not None:
        payload["rouge"] = rouge
    if linear_errors:
        payload["linear_errors"] = linear_error_summary(linear_errors)
    if expert_coverage is not None:
        payload["expert_coverage"] = expert_coverage
    if verify is not None:
        payload["verify"] = verify
    write_text_atomic(run.resolve(json_path), json.dumps(payload, indent=2, ensure_ascii=False) + "\n")
    write_text_atomic(run.resolve(md_path), _markdown(payload))
    return payload


def linear_error_summary(errors: dict[str, Any]) -> dict[str, Any]:
    """Mean relative output error of the Linears of each decoder layer, RTN and as quantized."""
    layers: dict[int, list[dict[str, float]]] = {}
    for name, e in errors["linears"].items():
        index = next((int(p) for p in name.split(".") if p.isdigit()), -1)
        layers.setdefault(index, []).append(e)
    rows = [{"layer": i, **_means(es)} for i, es in sorted(layers.items())]
    every = list(errors["linears"].values())
    mean = _means(every) if every else {}
    return {"tokens_per_linear": errors["tokens_per_linear"], "mean": mean, "layers": rows}


def _means(errors: list[dict[str, float | None]]) -> dict[str, float]:
    """Mean of each error kind over the Linears that have it (MoE experts may lack `quantized`)."""
    out = {}
    for k in ("rtn", "quantized"):
        values = [e[k] for e in errors if e.get(k) is not None]
        out[k] = round(sum(values) / len(values), 6) if values else None
    return out


def _markdown(p: dict[str, Any]) -> str:
    lines = [
        f"# quantlab report — {p['recipe']}",
        "",
        f"- model: `{p['model']}`",
        f"- stages: {' → '.join(p['stages'])}",
        f"- scheme: {p['scheme']} ({p['quantized_linears']} Linears)",
        f"- quantization time: {p['quantize_seconds']} s",
        "",
    ]
    if p["perplexity"]:
        first = p["perplexity"][0]
        lines += [
            f"## Perplexity — `{first['dataset']}`",
            "",
            f"Windows of {first['seq_len']} tokens, non-overlapping, joined with \"\\n\\n\": "
            f"{first['windows']} of {first['windows_available']} windows, "
            f"{first['tokens_scored']} tokens scored of {first['tokens_total']}.",
            "",
            "| model | perplexity | Δ vs float | windows | tokens scored |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in p["perplexity"]:
            delta = "—" if r["delta_vs_float_pct"] is None else f"{r['delta_vs_float_pct']:+.2f}%"
            lines.append(f"| {r['model']} | {r['perplexity']:.4f} | {delta} | {r['windows']} | {r['tokens_scored']} |")
    if p.get("divergence"):
        d = p["divergence"]
        lines += ["", "## Divergence from float", "",
                  f"On the same {d['windows']} windows ({d['tokens_scored']} tokens): KL(float ‖ quantized) per token "
                  f"mean {d['mean_kld']:.5f}, 99th percentile {d['p99_kld']:.5f}, max {d['max_kld']:.4f}; the "
                  f"quantized model's top token is the float model's at {100 * d['top1_agreement']:.2f}% of positions."]
    if p.get("rouge"):
        lines += ["", *_rouge_markdown(p["rouge"])]
    m = p.get("linear_errors", {}).get("mean") or {}
    if m.get("quantized") is not None and m.get("rtn") is not None:
        lines += ["", "## Linear output error", "",
                  f"Mean relative output error of the quantized Linears on {p['linear_errors']['tokens_per_linear']} "
                  f"calibration tokens each: {m['quantized']:.4f} as quantized, {m['rtn']:.4f} for plain "
                  "round-to-nearest of the same weights (per Linear: `linear_errors.json`)."]
    if p.get("expert_coverage"):
        lines += ["", *_coverage_markdown(p["expert_coverage"])]
    if p.get("verify"):
        lines += ["", *_verify_markdown(p["verify"])]
    versions = ", ".join(f"{k} {v}" for k, v in p["versions"].items())
    lines += ["", f"_{versions}_", ""]
    return "\n".join(lines)


def _coverage_markdown(c: dict[str, Any]) -> list[str]:
    """Tokens routed to the experts of each MoE layer, the experts none reached and their fallback."""
    how = ("every expert's statistics saw every calibration token (`calibration.all_experts`)" if c["all_experts"]
           else "each expert's statistics saw only the tokens routed to it")
    lines = ["## Expert coverage", "",
             f"{c['experts_unreached']} of {c['experts']} experts got no routed calibration token; {how}.", "",
             "| experts module | tokens routed | min / max per expert | experts with none |", "|---|---:|---:|---|"]
    for row in c["layers"]:
        none = ", ".join(map(str, row["unreached"])) or "—"
        lines.append(f"| {row['module']} | {row['total']} | {row['min']} / {row['max']} | {none} |")
    if c["fallbacks"]:
        lines += ["", "Experts without tokens: " + "; ".join(f"{k}: {v}" for k, v in c["fallbacks"].items()) + "."]
    return lines


def _verify_markdown(v: dict[str, Any]) -> list[str]:
    """The runner-verification section: agreement, logit error, perplexities, per-layer errors."""
    lo, hi = v["prompt_tokens"]
    lines = [
        "## Runner verification",
        "",
        f"quantlab's runner against the fake-quant model ({v['device']}, {v['dtype']}): {v['prompts']} prompts "
        f"of {lo if lo == hi else f'{lo}–{hi}'} tokens, {v['max_new_tokens']} greedy tokens each.",
        "",
        f"- greedy agreement (fake-quant argmax given the runner's context): "
        f"{100 * v['greedy_agreement']:.2f}% of {v['tokens_compared']} tokens; "
        f"{v['prompts_fully_agreeing']}/{v['prompts']} prompts agree on every token",
        f"- final logits: relative error {v['logits']['rel']:.3e}, max abs {v['logits']['max_abs']:.3e}",
    ]
    floor = v.get("reference_floor")
    if floor:
        lines.append(f"- reference floor (the fake-quant model against its own float64 copy): agreement "
                     f"{100 * floor['greedy_agreement']:.2f}%, logit relative error {floor['logits_rel']:.3e}")
    ppl = v.get("perplexity")
    if ppl:
        r, f = ppl["runner"], ppl["fake_quant"]
        lines.append(f"- perplexity ({r['windows']} windows × {r['seq_len']}): runner {r['perplexity']:.4f}, "
                     f"fake quant {f['perplexity']:.4f} ({ppl['rel_diff_pct']:+.3f}%)")
    lines += ["", "| layer | max abs | mean abs | rel |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['layer']} | {r['max_abs']:.3e} | {r['mean_abs']:.3e} | {r['rel']:.3e} |" for r in v["layers"]]
    return lines


ROUGE_NAMES = {"rouge1": "ROUGE-1", "rouge2": "ROUGE-2", "rougeL": "ROUGE-L", "rougeLsum": "ROUGE-Lsum"}


def _rouge_markdown(r: dict[str, Any]) -> list[str]:
    q = r["quantized"]
    tokens = "words, Porter stemmer" if q["tokenize"] == "words" else "characters (unsegmented script)"
    lines = ["## ROUGE", "",
             f"`{q['dataset']}`: {q.get('samples', '?')} samples, {q['prompt']} prompt, greedy, scored by {tokens}; "
             "F-measure in points, the difference with its paired bootstrap 95% interval.", "",
             "| model | " + " | ".join(ROUGE_NAMES.values()) + " | samples/s | generator |",
             "|---|" + "---:|" * (len(ROUGE_NAMES) + 2)]
    for meta in (r.get("float"), q):
        if meta:
            lines.append(f"| {meta['model']} | " + " | ".join(f"{meta[k]:.2f}" for k in ROUGE_NAMES)
                         + f" | {meta['samples_per_s']:.3f} | {meta['generator']} |")
    if r.get("difference"):
        d = r["difference"]
        lines.append("| Δ quantized − float | " + " | ".join(
            f"{d[k]['mean']:+.2f} [{d[k]['ci95'][0]:+.2f}, {d[k]['ci95'][1]:+.2f}]" for k in ROUGE_NAMES) + " | | |")
        lines += ["", f"Identical summaries (float and quantized): {100 * r['identical_summaries']:.1f}%."]
    return lines
