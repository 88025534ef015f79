"""The peers' AWQ W4 g64 asym rows of peers_cpu.py, quantized on a GPU machine.

On a 2-core CPU llm-compressor's and GPTQModel's AWQ take ~2.5 h each. Here they quantize on
one GPU, with the same 128 × 512 calibration ids and the same evaluation tokens as peers_cpu.py
(peers_cpu.prepare_inputs), scored by the same scripts (benchmarks/peers/*.py through peers/on_gpu.py, which only moves their load and quantlab's
perplexity onto the GPU). Same-hardware controls: the float model (scored on that machine's
CPU by float_run.py, and on its GPU) and quantlab's own AWQ g64 asym with `device: cuda`.

The GPU machine has no network: the float model travels as the GGUF it is made from (98 MB,
in two chunks over two back-to-back calls: 64 MiB a call), is dequantized there by quantlab's
own `float_checkpoint` and checked against the local copy by a digest of all its tensors.
Peer packages travel as wheels in `.whl/` (WHEELS: versions as pinned by peers_cpu.py; not
torchao, which gptqmodel lists but imports lazily: 0.18 breaks transformers' import on torch 2.11).

    .venv/bin/python benchmarks/peers_gpu_awq.py prepare [--wheels]   # here; prints the device commands
    (the two `run` calls it prints; copy the second call's files into runs/peers_gpu_awq/back/)
    .venv/bin/python benchmarks/peers_gpu_awq.py report runs/peers_gpu_awq/back/summary.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers_cpu as pc  # noqa: E402  (stdlib-only at import: runs on the device too)

CARRY = pc.REPO / "runs" / "peers_gpu_awq"  # runs/ is git-ignored
WHEELS_DIR = pc.REPO / ".whl"
SPLIT = 50_000_000  # GGUF bytes in the first call
ROOT = Path("/root/gpu_awq")  # on the device
RESULTS = pc.REPO / "benchmarks" / "results"
# Why a quantized row may score as the float model (the report marks such rows invalid).
INVALID = {"llmcompressor": (
    "after oneshot on a GPU compressed-tensors keeps the model CPU-offloaded and onloads a fresh copy of "
    "each weight per access, so its in-forward weight fake-quant is lost unless the offload is removed "
    "first (peers/on_gpu.py onload(); seen on the first lease, before that fix)")}
ROW_IDS = ["float", "float-cuda", "quantlab:awq-g64-asym", "llmcompressor:awq-g64-asym", "gptqmodel:awq-g64-asym"]
# Wheels for py3.12 the device lacks. BUILT ones have no wheel on PyPI: built here (gptqmodel
# with BUILD_CUDA_EXT=0, the CPU benchmark's build; the rest with a python3.12, --py312).
WHEELS = ["llmcompressor==0.14.0.1", "compressed-tensors==0.19.0", "loguru==0.7.3", "datasets==5.2.0",
          "dill==0.4.1", "multiprocess==0.70.19", "pydantic==2.14.3", "pydantic-core==2.50.4",
          "annotated-types==0.8.0", "typing-inspection==0.4.5", "typing-extensions==4.16.0",
          "platformdirs==4.14.7", "gguf==0.19.0"]
BUILT = ["device-smi==0.5.7", "pypcre==0.6.4", "tokenicer==0.0.14", "logbar==0.4.15", "defuser==0.0.28"]

DEVICE_1 = ("mkdir -p /root/stash && cp runs/peers_gpu_awq/a/gguf.part1 /root/stash/ && python3 -m pip install -q "
            "--no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site .whl/*.whl && "
            "PYTHONPATH=/root/site python3 benchmarks/peers_gpu_awq.py check")
DEVICE_2 = ("set -o pipefail; export PYTHONPATH=/root/site PYTHONUNBUFFERED=1; "
            "python3 benchmarks/peers_gpu_awq.py device 2>&1 | tee $OUT/setup.txt && "
            "python3 benchmarks/peers_gpu_awq.py wait --seconds 560")
DEVICE_3 = "PYTHONPATH=/root/site python3 benchmarks/peers_gpu_awq.py wait --seconds 560"


def tensor_digest(model_dir: Path) -> str:
    """sha256 over sorted tensor names, dtypes, shapes and raw bytes of model.safetensors."""
    from safetensors.torch import load_file

    tensors = load_file(str(model_dir / "model.safetensors"))
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.view(-1).view(__import__("torch").uint8).numpy().tobytes())
    return digest.hexdigest()


# --------------------------------------------------------------------------- here


def download_wheels(specs: list[str], dest: Path = WHEELS_DIR) -> None:
    """Binary wheels of `specs` for the device's CPython 3.12 on x86-64 Linux, without their deps."""
    platforms = [a for p in ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
                             "manylinux2014_x86_64") for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(dest), "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, *specs], check=True)


def fetch_wheels(py312: str) -> None:
    download_wheels(WHEELS)
    subprocess.run([py312, "-m", "pip", "wheel", "--no-deps", "-w", str(WHEELS_DIR), *BUILT], check=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                    str(WHEELS_DIR), "gptqmodel==7.6.0"], check=True, env={**os.environ, "BUILD_CUDA_EXT": "0"})


def prepare(args: argparse.Namespace) -> None:
    from quantlab.models.builtin import BUILTIN_MODELS, locate_gguf

    if args.wheels:
        fetch_wheels(args.py312)
    inputs = pc.prepare_inputs(args.work, 128)
    recorded = json.loads((pc.REPO / "benchmarks/results/peers_cpu.json").read_text())["inputs_hash"]
    gguf = locate_gguf(BUILTIN_MODELS[pc.MODEL_ALIAS])
    a, b = CARRY / "a", CARRY / "b"
    for d in (a, b):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    data = gguf.read_bytes()
    (a / "gguf.part1").write_bytes(data[:SPLIT])
    (b / "gguf.part2").write_bytes(data[SPLIT:])
    for f in (inputs.calib, inputs.eval_tokens, pc.TRAIN_FILE, pc.TEST_FILE):
        shutil.copy(f, b / f.name)
    local = {"inputs_hash": inputs.digest, "inputs_hash_recorded": recorded, "model_dir": str(inputs.model_dir),
             "tensor_digest": tensor_digest(inputs.model_dir), "gguf_sha256": pc.sha256_file(gguf)}
    (b / "local.json").write_text(json.dumps(local, indent=2) + "\n")
    print(json.dumps(local, indent=2))
    if inputs.digest != recorded:
        print(f"WARNING: inputs hash {inputs.digest} differs from peers_cpu.json's {recorded}")
    print("\ndevice call 1 (carry .whl, runs/peers_gpu_awq/a):\n  " + DEVICE_1)
    print("device call 2 at once (carry runs/peers_gpu_awq/b):\n  " + DEVICE_2)
    print("while rows remain (no carry):\n  " + DEVICE_3)


def report(args: argparse.Namespace) -> None:
    s = json.loads(Path(args.summary).read_text())
    floats = {r["id"]: r.get("perplexity") for r in s["rows"] if r["tool"] == "float"}
    cpu = {r["id"]: r for r in json.loads((pc.REPO / "benchmarks/results/peers_cpu.json").read_text())["rows"]}
    for r in s["rows"]:
        base = floats.get("float-cuda" if r["scored_on"] == "cuda" else "float")
        r["delta_vs_float_pct"] = (round(100 * (r["perplexity"] / base - 1), 2)
                                   if base and r.get("perplexity") and r["tool"] != "float" else None)
        ref = cpu.get(r["id"], {})
        r["cpu_perplexity"] = ref.get("perplexity") if ref.get("status") == "ok" else None
    for r in s["rows"]:  # a quantized row that scores as the float model did is not a result
        base = floats.get("float-cuda" if r["scored_on"] == "cuda" else "float")
        if r["tool"] != "float" and r.get("perplexity") and base and abs(r["perplexity"] / base - 1) < 1e-4:
            r["status"], r["error"] = "invalid", "scores as the float model: " + INVALID.get(r["tool"], "cause unknown")
    # one result per device: benchmarks/results/peers_gpu_awq_<gpu name as a slug>.json / .md
    out = RESULTS / f"peers_gpu_awq_{pc.device_slug(s['device']['gpu'])}.json"
    out.write_text(json.dumps(s, indent=2) + "\n")
    cols = ["row", "tool", "method", "scored on", "perplexity", "Δ vs float (same scorer)", "CPU-run ppl",
            "quantize s", "wall s", "status"]
    fmt = lambda v, f: "—" if v is None else format(v, f)  # noqa: E731
    lines = [f"# Peers' AWQ W4 g64 asym on {s['device']['gpu']}", "",
             f"- model: {pc.MODEL_ALIAS}, float32, built on the device from the GGUF by quantlab's "
             f"`float_checkpoint`; tensor digest here {s['digest_check']['local'][:16]}…, there "
             f"{s['digest_check']['device'][:16]}… — {'identical' if s['digest_check']['equal'] else 'DIFFERENT'}",
             f"- inputs: peers_cpu.prepare_inputs, inputs hash {s['inputs_hash']} (128 × 512 calibration ids; "
             f"first {s['windows']} windows × 2048 of WikiText-2 test)",
             "- quantized on the GPU and scored there with quantlab's perplexity (peers: their scripts through "
             "benchmarks/peers/on_gpu.py; quantlab: `device: cuda`). Δ is against the float model scored the same "
             "way; CPU-run ppl is the row in peers_cpu.json (2-core CPU).",
             f"- versions: {', '.join(f'{k} {v}' for k, v in s['versions'].items())}", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * 4 + "---:|" * 5 + "---|"]
    for r in s["rows"]:
        d = "—" if r.get("delta_vs_float_pct") is None else f"{r['delta_vs_float_pct']:+.2f}%"
        status = r["status"] + (f": {r['error']}" if r.get("error") else "")
        lines.append("| " + " | ".join([r["id"], r["tool"], r["method"], r["scored_on"], fmt(r.get("perplexity"), ".4f"),
                                        d, fmt(r.get("cpu_perplexity"), ".4f"), fmt(r.get("quantize_s"), ".1f"),
                                        fmt(r.get("wall_s"), ".1f"), status.replace("|", "\\|")]) + " |")
    notes = [f"- `{r['id']}`: " + "; ".join(r["notes"]) for r in s["rows"] if r.get("notes")]
    lines += ["", "## Notes", "", *notes] if notes else []
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


# --------------------------------------------------------------------------- there


def check(_: argparse.Namespace) -> None:
    """Call 1: versions and imports of everything the rows need."""
    subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv"])
    code = ("import importlib, torch; print(torch.__version__, torch.cuda.is_available())\n"
            "for m in ('llmcompressor', 'compressed_tensors', 'gptqmodel', 'datasets', 'gguf', 'pydantic', 'pcre', 'defuser', 'tokenicer'):\n"
            "    try: importlib.import_module(m); print('ok', m)\n"
            "    except Exception as e: print('FAIL', m, type(e).__name__, str(e)[:300])")
    subprocess.run([sys.executable, "-c", code], env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
    print(json.dumps(versions(), indent=1))


def versions() -> dict[str, str]:
    from importlib.metadata import version

    out = {}
    for pkg in ("torch", "transformers", "accelerate", "llmcompressor", "compressed-tensors", "gptqmodel",
                "datasets", "gguf", "quantlab"):
        try:
            out[pkg] = version(pkg)
        except Exception:
            out[pkg] = "not installed"
    return out


def child_env(pythonpath: str, **extra: str) -> dict[str, str]:
    """The CPU benchmark's child environment (offline, unbuffered), with the GPU visible."""
    return pc.child_env({"CUDA_VISIBLE_DEVICES": "0", "QUANTLAB_CACHE": str(ROOT / "qc"), "PYTHONPATH": pythonpath,
                         **extra})


def device(_: argparse.Namespace) -> None:
    """Call 2: the GGUF, the float model, quantlab installed; then the rows in the background."""
    b = CARRY / "b"
    local = json.loads((b / "local.json").read_text())
    gguf = ROOT / "qc" / "downloads" / pc.MODEL_ALIAS / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.parent.mkdir(parents=True, exist_ok=True)
    gguf.write_bytes(Path("/root/stash/gguf.part1").read_bytes() + (b / "gguf.part2").read_bytes())
    assert pc.sha256_file(gguf) == local["gguf_sha256"], "GGUF sha256 mismatch"
    site = ROOT / "qsite"  # quantlab installed (kernels/ becomes quantlab.kernels), for `quantlab run`
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(site), str(pc.REPO)], check=True)
    env = child_env(f"{site}:/root/site")
    subprocess.run([sys.executable, "-c", "from quantlab.models.builtin import float_checkpoint as f; "
                    f"print(f({pc.MODEL_ALIAS!r}))"], env=env, check=True, cwd=ROOT)
    model = ROOT / "qc" / "models" / pc.MODEL_ALIAS
    digest = tensor_digest(model)
    summary = {"device": {"gpu": subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                                capture_output=True, text=True).stdout.strip(),
                          "cpus": os.cpu_count()},
               "inputs_hash": local["inputs_hash"], "windows": 20, "versions": {},
               "digest_check": {"local": local["tensor_digest"], "device": digest,
                                "equal": digest == local["tensor_digest"]}, "rows": []}
    (ROOT / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    launch()


def launch(_: argparse.Namespace | None = None) -> None:
    """The rows (env ROWS: comma-separated ids, default all) in a process of their own."""
    site = ROOT / "qsite"
    (ROOT / "done").unlink(missing_ok=True)
    log = open(ROOT / "rows.log", "ab")
    subprocess.Popen([sys.executable, __file__, "rows"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                     env={**os.environ, "PYTHONPATH": f"{site}:/root/site"})


def rows(_: argparse.Namespace) -> None:
    import yaml

    b, model = CARRY / "b", ROOT / "qc" / "models" / pc.MODEL_ALIAS
    summary = json.loads((ROOT / "summary.json").read_text())
    summary["versions"] = versions()
    pp = pc.python_path_dir(ROOT)  # only a `quantlab` link (see peers_cpu.python_path_dir)
    peer_path = f"{pp}:/root/site"
    common = ["--model", str(model), "--calib", str(b / "calib.safetensors"), "--eval", str(b / "eval_tokens.safetensors"),
              "--seq-len", str(pc.EVAL_SEQ_LEN), "--damp", str(pc.DAMP), "--no-act-order", "--windows", "20"]
    awq = ["--method", "awq", "--bits", "4", "--group-size", "64", "--no-sym"]
    # Script rows: the script, or on_gpu.py and the unchanged script it runs on the GPU.
    scripts = {"float": ["float_run.py"], "float-cuda": ["on_gpu.py", "float_run.py"],
               "llmcompressor:awq-g64-asym": ["on_gpu.py", "llmcompressor_run.py"],
               "gptqmodel:awq-g64-asym": ["on_gpu.py", "gptqmodel_run.py"]}
    only = [i for i in os.environ.get("ROWS", "").split(",") if i]
    summary["rows"] = [r for r in summary["rows"] if r["id"] not in only]
    for rid in [i for i in ROW_IDS if not only or i in only]:
        folder = ROOT / "rows" / rid.replace(":", "__")
        folder.mkdir(parents=True, exist_ok=True)
        out = folder / "peer_result.json"
        tool, method = (rid.split(":") + [""])[:2]
        row = {"id": rid, "tool": "float" if rid.startswith("float") else tool, "method": method.split("-")[0] or "float",
               "scored_on": "cpu" if rid == "float" else "cuda", "notes": []}
        if rid in scripts:
            first, *runs = scripts[rid]
            method_args = ["--method", "float"] if row["tool"] == "float" else awq
            cmd = [sys.executable, str(pc.PEER_SCRIPTS / first), *runs, *common, *method_args,
                   "--workdir", str(folder), "--out", str(out)]
            env = child_env(peer_path, **({"GPTQMODEL_CPU_WORKERS": "2"} if tool == "gptqmodel" else {}))
        else:  # quantlab, with the benchmark's own recipe, on the GPU, data paths as carried
            r = pc.Row("quantlab", "awq", 64, False)
            recipe = yaml.safe_load(pc.quantlab_recipe(r, argparse.Namespace(windows=20, calib_samples=128), folder / "run"))
            recipe["device"] = "cuda"
            recipe["calibration"]["dataset"]["source"] = str(b / pc.TRAIN_FILE.name)
            recipe["evaluate"]["perplexity"]["dataset"]["source"] = str(b / pc.TEST_FILE.name)
            (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
            cmd, env = [sys.executable, "-m", "quantlab", "run", str(folder / "recipe.yaml")], child_env(os.environ["PYTHONPATH"])
        print(f"== {rid}: {' '.join(cmd)[:300]}", flush=True)
        start = time.perf_counter()
        with (folder / "log.txt").open("wb") as fh:
            rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=folder, timeout=3000).returncode
        row["wall_s"] = round(time.perf_counter() - start, 1)
        if tool == "quantlab":
            run = folder / "run"
            try:
                import torch
                from safetensors.torch import load_file

                ppl = json.loads((run / "reports" / "perplexity_quantized.json").read_text())
                cfg = json.loads((run / "quantized" / "quant_config.json").read_text())
                same = torch.equal(load_file(str(run / "calib" / "tokens.safetensors"))["input_ids"],
                                   load_file(str(b / "calib.safetensors"))["input_ids"])
                row["notes"].append(f"calibration ids {'identical to' if same else 'DIFFER from'} the shared set")
                payload = {"status": "ok" if same else "failed", "perplexity": ppl,
                           "seconds": {"quantize": cfg.get("quantize_seconds"), "eval": ppl.get("seconds")}}
            except Exception as exc:
                payload = {"status": "failed", "error": f"exit {rc}: {type(exc).__name__}: {exc}"}
        else:
            payload = json.loads(out.read_text()) if out.is_file() else {"status": "failed", "error": f"exit {rc}, no result"}
        p = payload.get("perplexity")
        row.update(status=payload.get("status"), error=payload.get("error"), perplexity=p and p["perplexity"],
                   windows=p and p["windows"], quantize_s=payload.get("seconds", {}).get("quantize"),
                   eval_s=payload.get("seconds", {}).get("eval"), tool_versions=payload.get("versions"),
                   kernel=payload.get("kernel"), config=payload.get("config"))
        row["notes"] += payload.get("workarounds", []) + payload.get("notes", [])
        summary["rows"].append(row)
        (ROOT / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"== {rid}: {row['status']} ppl {row['perplexity']} quantize {row['quantize_s']} s wall {row['wall_s']} s",
              flush=True)
    (ROOT / "done").write_text("done\n")


def wait(args: argparse.Namespace) -> None:
    """Until the rows are done or `--seconds` pass; then summary, logs and row logs into $OUT."""
    deadline = time.time() + args.seconds
    while time.time() < deadline and not (ROOT / "done").exists():
        time.sleep(5)
    out = Path(os.environ.get("OUT", "/tmp/out"))
    shutil.copy(ROOT / "summary.json", out / "summary.json")
    shutil.copy(ROOT / "rows.log", out / "rows.log")
    with (out / "row_logs.txt").open("w") as fh:
        for log in sorted((ROOT / "rows").glob("*/log.txt")):
            text = log.read_text(errors="replace")
            fh.write(f"\n######## {log.parent.name}\n{text[-200_000:]}")
    print((ROOT / "rows.log").read_text()[-4000:])
    print("DONE" if (ROOT / "done").exists() else "ROWS STILL RUNNING")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("prepare")
    s.add_argument("--wheels", action="store_true", help="download / build the wheels into .whl first")
    s.add_argument("--py312", default="python3.12", help="a Python 3.12 to build the sdist-only wheels")
    s.add_argument("--work", type=Path, default=None, help="peers_cpu --work (default: its own)")
    s = sub.add_parser("report")
    s.add_argument("summary")
    sub.add_parser("check")
    sub.add_parser("device")
    sub.add_parser("rows")
    sub.add_parser("launch")
    s = sub.add_parser("wait")
    s.add_argument("--seconds", type=float, default=560)
    args = p.parse_args()
    if args.cmd == "prepare" and args.work is None:
        from quantlab.models.builtin import cache_root

        args.work = cache_root() / "bench" / "peers_cpu"
    {"prepare": prepare, "report": report, "check": check, "device": device, "rows": rows, "launch": launch, "wait": wait}[args.cmd](args)


if __name__ == "__main__":
    main()
