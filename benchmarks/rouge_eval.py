"""ROUGE, KL divergence and perplexity of the shipped SmolLM2 recipes, side by side, through the CLI.

    python benchmarks/rouge_eval.py [--samples 100] [--windows 40] [--root runs/bench-rouge]

Every case is `quantlab run <shipped recipe>` with the same evaluation: perplexity and
KL(float ‖ quantized) on `--windows` × 512 WikiText-2 test tokens, ROUGE of greedy summaries of
`--samples` CNN/DailyMail validation articles (chat template, article cut to 512 tokens, 100 new
tokens, batch 16). The runs sit side by side in one root, so the float baselines are evaluated once
(a sibling's finished float stages are reused) and the first run's two ROUGE stages time the
evaluation of float and quantized. Two LCSTS cases score Chinese by character.

The runner check: the AWQ W4 run's prompts are summarized again by the fake-quant model's own
transformers `generate` (greedy, left-padded batches); the two ROUGE scores and the share of
identical summaries are compared, and both generators are timed in one process.
`--retime` keeps the cases and measures the times again with nothing else running.

Writes `benchmarks/results/rouge_eval_cpu.{json,md}` (or `--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
CNN = DATA / "cnn_dailymail" / "cnn_dailymail_3.0.0_validation_first1000.jsonl"
LCSTS = DATA / "lcsts" / "LCSTS_PART_III_test_score_ge3_725.jsonl"
WIKI_TEST = DATA / "wikitext-2-raw-v1" / "wiki.test.raw"
WIKI_TRAIN = DATA / "wikitext-2-raw-v1" / "wiki.train.first1MB.raw"

# case → (shipped recipe, overrides, summarization set)
CASES: dict[str, tuple[str, list[str], Path]] = {
    "rtn-w8a16": ("smollm2_rtn_w8a16", [], CNN),
    "awq-w4-g64": ("smollm2_awq_w4a16", [], CNN),
    "gptq-w4-g64": ("smollm2_gptq_w4a16", [], CNN),
    "rtn-w4-g64": ("smollm2_rtn_w4a16", [], CNN),
    "lcsts-rtn-w8a16": ("smollm2_rtn_w8a16", [], LCSTS),
    "lcsts-rtn-w4-g64": ("smollm2_rtn_w4a16", [], LCSTS),
}
RUNNER_CHECK = "awq-w4-g64"


def run_case(case: str, root: Path, samples: int, windows: int) -> dict[str, Any]:
    recipe, sets, data = CASES[case]
    run_dir = root / case
    sets = [*sets, f"output.dir={run_dir}", f"calibration.dataset.source={WIKI_TRAIN}",
            f"evaluate.perplexity.dataset.source={WIKI_TEST}", f"evaluate.perplexity.max_windows={windows}",
            "evaluate.perplexity.seq_len=512",
            f"evaluate.rouge={{dataset: {{source: {data}}}, num_samples: {samples}}}"]
    args = [sys.executable, "-m", "quantlab", "run", str(REPO / "recipes" / f"{recipe}.yaml")]
    for s in sets:
        args += ["--set", s]
    start = time.perf_counter()
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{case} failed:\n{proc.stderr[-3000:]}")
    report = json.loads((run_dir / "reports" / "report.json").read_text())
    stages = json.loads((run_dir / "manifest.json").read_text())["stages"]
    rouge = report["rouge"]
    ppl = {p["model"]: p["perplexity"] for p in report["perplexity"]}
    return {
        "case": case, "recipe": recipe, "scheme": report["scheme"], "dataset": data.name,
        "wall_s": round(time.perf_counter() - start, 1),
        "ppl_float": ppl.get("float"), "ppl_quantized": ppl["quantized"],
        "kld_mean": report["divergence"]["mean_kld"], "kld_p99": report["divergence"]["p99_kld"],
        "top1": report["divergence"]["top1_agreement"],
        "rouge_float": {k: rouge["float"][k] for k in ("rouge1", "rouge2", "rougeL", "rougeLsum")},
        "rouge_quantized": {k: rouge["quantized"][k] for k in ("rouge1", "rouge2", "rougeL", "rougeLsum")},
        "difference": rouge["difference"], "identical_summaries": rouge["identical_summaries"],
        "tokenize": rouge["quantized"]["tokenize"],
        "rouge_seconds": {k: stages[k]["seconds"] for k in ("evaluate_rouge_float", "evaluate_rouge_quantized")},
        "float_reused": "reused_from" in stages["evaluate_rouge_float"],
    }


def runner_check(run_dir: Path, batch_size: int) -> dict[str, Any]:
    """ROUGE of the runner's summaries (the run's) against the fake-quant model's own `generate`."""
    import torch

    sys.path.insert(0, str(REPO))
    from transformers import AutoTokenizer

    from quantlab.eval import rouge, summaries
    from quantlab.eval.fake_quant import apply_from_canonical
    from quantlab.quant.canonical import load_fake_quant_model
    from quantlab.runner.generate import continuations
    from quantlab.runner.load import load_runner
    from quantlab.eval.summaries import read_jsonl

    meta, rows = read_jsonl(run_dir / "reports" / "rouge_quantized.jsonl")
    canonical = run_dir / "quantized"
    tokenizer = AutoTokenizer.from_pretrained(canonical)
    model = load_fake_quant_model(canonical, torch.float32).eval()
    apply_from_canonical(model, canonical)
    stop = summaries.stop_ids(tokenizer, meta["prompt"])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompts = [summaries.Prompt(r["index"], r["prompt"], tokenizer(r["prompt"], add_special_tokens=False).input_ids,
                                r["reference"]) for r in rows]
    assert all(len(p.ids) == r["prompt_tokens"] for p, r in zip(prompts, rows)), "prompt ids differ from the run's"
    done = summaries.generate_all(summaries.hf_generator(model, 100, stop, pad), prompts, batch_size, stop)
    texts = [tokenizer.decode(t, skip_special_tokens=True).strip() for t in done.tokens]
    refs = [r["reference"] for r in rows]
    hf = rouge.score(texts, refs, meta["tokenize"]).mean()
    runner = rouge.score([r["summary"] for r in rows], refs, meta["tokenize"]).mean()
    # the runner again on the same prompts in this process, for a time measured like transformers'
    runner_model = load_runner(canonical)
    longest = max(len(p.ids) for p in prompts) + 100
    again = summaries.generate_all(lambda b: continuations(runner_model, b, 100, stop, pad, max_seq_len=longest),
                                   prompts, batch_size, stop)
    return {"case": run_dir.name, "samples": len(rows), "runner": runner, "transformers_generate": hf,
            "abs_diff": {k: round(abs(runner[k] - hf[k]), 4) for k in runner},
            "identical_summaries": round(sum(a == r["summary"] for a, r in zip(texts, rows)) / len(rows), 4),
            "runner_reproduces_the_run": [tokenizer.decode(t, skip_special_tokens=True).strip() for t in again.tokens]
            == [r["summary"] for r in rows],
            "transformers_seconds": round(done.seconds, 1), "runner_seconds": round(again.seconds, 1)}


def retime(result: dict[str, Any], root: Path) -> dict[str, Any]:
    """The ROUGE stages of the first case again, alone on the machine: its run copied beside
    nothing (no sibling to reuse a float stage from), the summaries removed, `quantlab eval`."""
    import shutil
    import tempfile

    case = result["rouge_eval_seconds"]["case"]
    copy = Path(tempfile.mkdtemp(prefix="rouge-retime-")) / case
    shutil.copytree(root / case, copy)
    for name in ("rouge_float.jsonl", "rouge_quantized.jsonl", "rouge.json"):
        (copy / "reports" / name).unlink()
    proc = subprocess.run([sys.executable, "-m", "quantlab", "eval", str(copy)], cwd=REPO, capture_output=True,
                          text=True)
    if proc.returncode:
        raise SystemExit(f"retime failed:\n{proc.stderr[-3000:]}")
    stages = json.loads((copy / "manifest.json").read_text())["stages"]
    f, q = stages["evaluate_rouge_float"]["seconds"], stages["evaluate_rouge_quantized"]["seconds"]
    return {"case": case, "float": f, "quantized": q, "total": round(f + q, 1), "alone": True}


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# ROUGE / KLD / perplexity — SmolLM2-135M-Instruct ({result['device']})", "",
             f"{result['samples']} articles, {result['windows']} × 512 WikiText-2 windows; "
             f"`python benchmarks/rouge_eval.py`. ROUGE F in points; Δ = quantized − float with its paired "
             "bootstrap 95% interval.", "",
             "| case | scheme | set | ppl | KL mean | KL p99 | top-1 | R-1 | R-2 | R-L | Δ R-1 [95%] | Δ R-L [95%] |"
             " identical |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    seen_float: set[str] = set()
    for r in result["cases"]:
        if r["dataset"] not in seen_float:
            seen_float.add(r["dataset"])
            f = r["rouge_float"]
            lines.append(f"| float | — | {r['dataset'][:14]} | {r['ppl_float']:.3f} | 0 | 0 | 100% | {f['rouge1']:.2f} | "
                         f"{f['rouge2']:.2f} | {f['rougeL']:.2f} | | | |")
        q, d = r["rouge_quantized"], r["difference"]
        lines.append(
            f"| {r['case']} | {r['scheme']} | {r['dataset'][:14]} | {r['ppl_quantized']:.3f} | {r['kld_mean']:.4f} | "
            f"{r['kld_p99']:.3f} | {100 * r['top1']:.1f}% | {q['rouge1']:.2f} | {q['rouge2']:.2f} | {q['rougeL']:.2f} | "
            f"{d['rouge1']['mean']:+.2f} [{d['rouge1']['ci95'][0]:+.2f}, {d['rouge1']['ci95'][1]:+.2f}] | "
            f"{d['rougeL']['mean']:+.2f} [{d['rougeL']['ci95'][0]:+.2f}, {d['rougeL']['ci95'][1]:+.2f}] | "
            f"{100 * r['identical_summaries']:.0f}% |")
    t = result["rouge_eval_seconds"]
    lines += ["", f"ROUGE evaluation time of {result['samples']} articles, float + quantized ({t['case']}, "
              f"{result['threads']} threads{', nothing else running (--retime)' if t.get('alone') else ''}): "
              f"{t['float']:.0f} s + {t['quantized']:.0f} s = {t['total']:.0f} s."]
    c = result.get("runner_check")
    if c:
        lines += ["", f"Runner vs the fake-quant model's own transformers `generate` ({c['case']}, {c['samples']} "
                  "prompts, greedy):", "", "| generator | R-1 | R-2 | R-L | R-Lsum | seconds |", "|---|---:|---:|---:|---:|---:|"]
        for name, key, sec in (("runner", "runner", c["runner_seconds"]),
                               ("transformers generate", "transformers_generate", c["transformers_seconds"])):
            s = c[key]
            lines.append(f"| {name} | {s['rouge1']:.2f} | {s['rouge2']:.2f} | {s['rougeL']:.2f} | {s['rougeLsum']:.2f} "
                         f"| {sec} |")
        lines += ["", f"Identical summaries: {100 * c['identical_summaries']:.0f}%; largest |Δ|: "
                  f"{max(c['abs_diff'].values()):.2f} points. Both timed in one process, batch 16"
                  + ("; the runner regenerated the run's summaries exactly." if c.get("runner_reproduces_the_run")
                     else ".")]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=100)
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--root", type=Path, default=REPO / "runs" / "bench-rouge")
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "rouge_eval_cpu")
    ap.add_argument("--retime", action="store_true", help="keep the cases of --out's JSON; time the ROUGE stages "
                    "and the runner check again with nothing else running")
    args = ap.parse_args()
    if args.retime:
        result = json.loads(args.out.with_suffix(".json").read_text())
        result["rouge_eval_seconds"] = retime(result, args.root)
        result["runner_check"] = runner_check(args.root / RUNNER_CHECK, 16)
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
        args.out.with_suffix(".md").write_text(markdown(result))
        print(markdown(result))
        return
    args.root.mkdir(parents=True, exist_ok=True)
    cases = []
    for case in args.cases:
        cases.append(run_case(case, args.root, args.samples, args.windows))
        print(json.dumps(cases[-1]), flush=True)
    first = next(c for c in cases if not c["float_reused"])
    seconds = first["rouge_seconds"]
    result = {"device": "cpu", "threads": int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)),
              "samples": args.samples, "windows": args.windows, "cases": cases,
              "rouge_eval_seconds": {"case": first["case"], "float": seconds["evaluate_rouge_float"],
                                     "quantized": seconds["evaluate_rouge_quantized"],
                                     "total": seconds["evaluate_rouge_float"] + seconds["evaluate_rouge_quantized"]}}
    if RUNNER_CHECK in args.cases:
        result["runner_check"] = runner_check(args.root / RUNNER_CHECK, 16)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
