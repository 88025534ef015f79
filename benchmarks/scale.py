"""quantlab's quantize stage on big model shapes on H200 machines, next to llm-compressor's
`oneshot` GPTQ on the same GPU(s) and the same calibration ids.

Models: Qwen2-7B, Qwen2.5-32B and Qwen2-72B shapes (`SHAPES`) with RANDOM bf16 weights (seeded,
std 0.02, norms 1; random weights cost what trained ones cost), written on the device as a
Hugging Face checkpoint one decoder layer at a time (`build`), whole or as the first N layers
(`--layers N`: a slice; config num_hidden_layers = N). Tokenizer: SmolLM2's (its ids < 49152
are valid ids of the 152064-row embedding).

Same inputs for every tool. quantlab runs its product path: `quantlab run` of a recipe in
runs/scale/recipes/ whose `calibration.dataset` is a carried copy of the WikiText-2 train slice
(random windows, seed 0; 128 × 2048 for GPTQ, 128 × 512 for AWQ). On the device, before the
rows, the runner draws those ids once more with quantlab's own tokenizer loader and sampler on
the built model directory (`draw-ids`, /root/scale/ids/); each quantlab row must save exactly
these ids in `<run>/calib/tokens.safetensors` (`calib_identical`, else the row fails), and
llm-compressor gets them as a `datasets.Dataset` of input_ids / attention_mask. `prepare` (here)
draws them the same way and keeps them in runs/scale/ as the reference the device's draw is
compared with (`equal_to_prepared`, `prepared_identical`: a different transformers could
tokenize differently).

Rows (`--rows`): `quantlab-gptq` (W4 g128 sym, act_order with static groups, true_sequential,
damp 0.01, quantlab's default mse_clip; 128 × 2048), `quantlab-awq` (W4 g128 asym, quantlab's
defaults: the scale search observes `max_tokens` 8192 of the 128 × 512 tokens per layer, every
token flows through the layers; 128 × 512), `llmcompressor-gptq` (`GPTQModifier(targets="Linear",
scheme="W4A16", ignore=["lm_head"], actorder="static", dampening_frac=0.01)`, 128 × 2048).
llm-compressor 0.14 takes only "static" (= "weight", its default: columns in descending
Hessian-diagonal order, groups in the original column order, no g_idx) for GPTQ and refuses
"group" (g_idx), so quantlab's recipe sets `static_groups: true`, the same ordering. GPU
counts (`--gpus 1,2`): quantlab through `quantlab run --gpus N` where its CLI has the flag (a
row asking for N > 1 is skipped otherwise), llm-compressor through `torchrun` (its distributed
oneshot: data-parallel calibration, GPTQ modules spread over the ranks).

Measured per row, each in a process of its own (the runner polls nvidia-smi meanwhile):
  * time: quantlab's `quantize_seconds` (quant_config.json: the quantize stage's layer loop,
    layer writes included, model load excluded), the run manifest's quantize-stage seconds (with
    the load), and the process's wall time; llm-compressor's `oneshot` wall time (model loaded
    before it; the slowest rank);
  * peak GPU memory per rank: quantlab's own `peak_gpu_bytes` / `peak_gpu_reserved_bytes` from
    quant_config.json where it records them, else torch.cuda.max_memory_allocated / _reserved
    read in the quantlab process after its CLI returns; llm-compressor: the same torch figures
    in each rank; and nvidia-smi's peak memory.used per GPU for every row;
  * peak host RSS: getrusage ru_maxrss of the row's process tree (os.wait4), per rank where
    ranks report it;
  * the memory plan's estimate: quant_config.json's `memory_plan` if the quantize stage writes
    one, else `quantlab.memory_plan.plan_for` (imported guarded; None where absent).

Commands

    .venv/bin/python benchmarks/scale.py prepare --wheels   # here: ids, recipes, tokenizer → runs/scale, wheels → .whl
    device calls: carry [".whl", "runs/scale"], timeout_s 600; kind nvidia-h200 (1 GPU) or nvidia-h200-x2 (1 and 2):
      python3 benchmarks/scale.py device --shape qwen2-7b --rows quantlab-gptq,quantlab-awq,llmcompressor-gptq --gpus 1,2
      python3 benchmarks/scale.py device --shape qwen2-72b --layers 8 --rows quantlab-gptq,llmcompressor-gptq --gpus 1,2
      while a call ends with "ROWS STILL RUNNING", send the same command again at once; copy each
      call's files into a folder of their own here, e.g. runs/scale_back/<kind>-<n>/ (not under
      runs/scale, which is carried)
    .venv/bin/python benchmarks/scale.py report runs/scale_back   # → benchmarks/results/scale_nvidia_h200.{json,md}

`device` installs the wheels and quantlab (once per machine), starts the runner in a process
session of its own (it builds the model under /root/scale/models, then runs the rows in order,
writing /root/scale/out/scale_rows.json after each), and copies that file and the logs into $OUT
every 10 s until the rows are done or `--wait` (570 s) passes. Rows still running: call the SAME
command again at once (the machine is given back 30 s after a call), carrying the same paths; it
launches nothing new while the runner lives and skips rows already done. Output files:
scale_rows.json (cumulative for the machine), runner.log, row_logs.txt, setup.log, build.log. `--layers`
defaults to the shape's full count; `--row-timeout` (default 3000 s) stops one row; a 1-GPU
machine records `--gpus 2` rows as skipped. Disk: the 7B (15 GB) and the 72B 8-layer slice
(19 GB) fit the 1-GPU machine's 64 GB (each row's quantized shards are deleted once read); a
full Qwen2.5-32B (65 GB) needs the 2-GPU machine's 128 GB; a full 72B (145 GB) fits neither,
hence slices and the report's per-layer extrapolation. Host memory: quantlab reads layers lazily;
llm-compressor holds the whole bf16 model in host RAM.

Local checks: `build --shape qwen2-7b --layers 1 --out /tmp/x`; `rows --shape tiny --device cpu
--root /tmp/scale --site DIR_WITH_LLMCOMPRESSOR` runs every row on a 2-layer model on the CPU
(quantlab's 2-process rows over gloo).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import inspect
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

REPO = Path(__file__).resolve().parents[1]


def peers() -> tuple[Any, Any]:
    """benchmarks/peers_cpu.py and peers_gpu_awq.py, imported on first use: they import quantlab,
    which the device has only once `device` has installed it (the runner and rows run after)."""
    import peers_cpu
    import peers_gpu_awq

    return peers_cpu, peers_gpu_awq

CARRY = REPO / "runs" / "scale"  # runs/ is git-ignored: carried
TOKENIZER_DIR = CARRY / "tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TRAIN_COPY = CARRY / "wiki.train.first1MB.raw"  # a copy of peers_cpu.TRAIN_FILE (../shared does not travel)
RECIPES_DIR = CARRY / "recipes"
PREPARED = CARRY / "prepare.json"
SAMPLES = 128
CALIB = {2048: CARRY / f"calib_{SAMPLES}x2048.safetensors", 512: CARRY / f"calib_{SAMPLES}x512.safetensors"}
RESULTS = REPO / "benchmarks" / "results"
DEVICE_ROOT = Path("/root/scale")
SITE = Path("/root/site")
MODEL_PLACEHOLDER = "/root/scale/models/SET-BY-THE-RUNNER"
DEVICE_CMD = ("python3 benchmarks/scale.py device --shape qwen2-7b "
              "--rows quantlab-gptq,quantlab-awq,llmcompressor-gptq --gpus 1,2")
DEVICE_CMD_72B = ("python3 benchmarks/scale.py device --shape qwen2-72b --layers 8 "
                  "--rows quantlab-gptq,llmcompressor-gptq --gpus 1,2")
CARRY_PATHS = [".whl", "runs/scale"]
GiB = 2**30


# --------------------------------------------------------------------------- shapes


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int = 152064
    rope_theta: float = 1e6
    rms_eps: float = 1e-6
    max_positions: int = 32768

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def layer_tensors(self) -> dict[str, tuple[int, ...]]:
        h, i, kv = self.hidden, self.intermediate, self.kv_heads * self.head_dim
        return {"self_attn.q_proj.weight": (h, h), "self_attn.q_proj.bias": (h,),
                "self_attn.k_proj.weight": (kv, h), "self_attn.k_proj.bias": (kv,),
                "self_attn.v_proj.weight": (kv, h), "self_attn.v_proj.bias": (kv,),
                "self_attn.o_proj.weight": (h, h),
                "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
                "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}

    def layer_params(self) -> int:
        total = 0
        for shape in self.layer_tensors().values():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total

    def bf16_bytes(self, layers: int) -> int:
        return 2 * (layers * self.layer_params() + 2 * self.vocab * self.hidden + self.hidden)


# rms eps: Qwen2-7B's 1e-6 for the 7B and 72B, 1e-5 for Qwen2.5-32B; immaterial with random weights.
SHAPES = {
    "qwen2-7b": Shape(3584, 18944, 28, 28, 4, max_positions=131072),
    "qwen2.5-32b": Shape(5120, 27648, 64, 40, 8, rms_eps=1e-5),
    "qwen2-72b": Shape(8192, 29568, 80, 64, 8),
    "tiny": Shape(256, 768, 2, 4, 2, vocab=49152),  # CPU smoke test
}

# row id → (tool, algorithm, calibration seq_len, recipe file, what it is)
ROWS = {
    "quantlab-gptq": ("quantlab", "gptq", 2048, "gptq_w4g128.yaml",
                      "W4 g128 sym, act_order with static groups, true_sequential, damp 0.01, "
                      "mse_clip (quantlab default)"),
    "quantlab-gptq-offload": ("quantlab", "gptq", 2048, "gptq_w4g128.yaml",
                              "as quantlab-gptq, with calibration.offload: cpu (activations on the host)"),
    "quantlab-awq": ("quantlab", "awq", 512, "awq_w4g128.yaml",
                     "W4 g128 asym, grid 20, duo scaling, clip, max_tokens 8192 (quantlab defaults)"),
    "llmcompressor-gptq": ("llmcompressor", "gptq", 2048, None,
                           'GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"], '
                           'actorder="static", dampening_frac=0.01, block_size=128)'),
}
ROW_SETTINGS = {"quantlab-gptq-offload": ["calibration.offload=cpu"]}  # --set overrides of a row

RECIPE = """\
# benchmarks/scale.py: quantlab's quantize stage on big random-weight Qwen2 shapes (no evaluation,
# no export). model.id and output.dir are set by the runner with --set; relative paths resolve
# against the repository root (the runner's working directory).
name: {name}
seed: 0
device: cuda
model:
  id: {{model}}
  dtype: bfloat16
calibration:
  dataset:
    source: runs/scale/{{train}}
  num_samples: {{samples}}
  seq_len: {seq_len}
  strategy: random_windows
stages:
{stage}"""
GPTQ_RECIPE = RECIPE.format(name="scale_gptq_w4g128", seq_len=2048, stage="""\
  - gptq:
      weights: {{bits: 4, symmetric: true, group_size: 128}}
      damp_percent: 0.01
      block_size: 128
      act_order: true
      static_groups: true
      true_sequential: true
      mse_clip: true
""")
AWQ_RECIPE = RECIPE.format(name="scale_awq_w4g128", seq_len=512, stage="""\
  - awq:
      weights: {{bits: 4, symmetric: false, group_size: 128}}
      grid: 20
      duo_scaling: true
      clip: true
      max_tokens: 8192
""")


def now() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def write_json(path: Path, payload: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(path)


def dir_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


# --------------------------------------------------------------------------- prepare (here)


def prepare(args: argparse.Namespace) -> None:
    from quantlab.models.builtin import cache_root

    pc, pga = peers()
    if args.wheels:  # the list that ran llm-compressor on the device before: its and quantlab's missing packages
        pga.download_wheels(pga.WHEELS)
    CARRY.mkdir(parents=True, exist_ok=True)
    TOKENIZER_DIR.mkdir(exist_ok=True)
    source = cache_root() / "models" / pc.MODEL_ALIAS
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, TOKENIZER_DIR / name)
    shutil.copy(pc.TRAIN_FILE, TRAIN_COPY)
    RECIPES_DIR.mkdir(exist_ok=True)
    for template, name in ((GPTQ_RECIPE, ROWS["quantlab-gptq"][3]), (AWQ_RECIPE, ROWS["quantlab-awq"][3])):
        (RECIPES_DIR / name).write_text(template.format(model=MODEL_PLACEHOLDER, train=TRAIN_COPY.name,
                                                        samples=SAMPLES))
    info = {"prepared": now(), "tokenizer": {n: pc.sha256_file(TOKENIZER_DIR / n) for n in TOKENIZER_FILES},
            "train_file": {"name": TRAIN_COPY.name, "sha256": pc.sha256_file(TRAIN_COPY)}, "calibration": {}}
    probe = Path(tempfile.mkdtemp(prefix="scale_tokenizer_"))  # what `build` writes, without weights
    write_json(probe / "config.json", qwen2_config(SHAPES["tiny"], 1))
    for name in TOKENIZER_FILES:
        shutil.copy(TOKENIZER_DIR / name, probe / name)
    for row in ("quantlab-gptq", "quantlab-awq"):
        ids = sample_ids(RECIPES_DIR / ROWS[row][3], probe)
        path = CALIB[ids.shape[1]]
        from safetensors.torch import save_file

        save_file({"input_ids": ids.contiguous()}, str(path))
        info["calibration"][path.name] = {"shape": list(ids.shape), "dtype": str(ids.dtype),
                                          "sha256": pc.sha256_file(path), "first_ids": ids[0, :8].tolist(),
                                          "max_id": int(ids.max())}
    write_json(PREPARED, info)
    print(json.dumps(info, indent=2))
    sizes = {p: dir_bytes(REPO / p) for p in CARRY_PATHS}
    for p, n in sizes.items():
        print(f"carry {p}: {n / 2**20:.1f} MiB")
    print(f"carried in all: {sum(sizes.values()) / 2**20:.1f} MiB (limit 64 MiB with the working tree)")
    if not (REPO / ".whl").is_dir():
        print("WARNING: .whl/ missing: run `prepare --wheels` before the device call")
    print(f"\ndevice call (carry {json.dumps(CARRY_PATHS)}, timeout_s 600):\n  {DEVICE_CMD}\n"
          f"72B slice:\n  {DEVICE_CMD_72B}\nrepeat a call at once while it ends with ROWS STILL RUNNING; each "
          f"call's files into runs/scale_back/<kind>-<n>/, then here:\n  .venv/bin/python benchmarks/scale.py report "
          f"runs/scale_back")


def sample_ids(recipe_path: Path, model_dir: Path):
    """The calibration ids `quantlab run` draws for this recipe on the model in `model_dir`: the
    run's own tokenizer loader and calibration functions (`RunContext.tokenizer`,
    `stages.calibrate`), from the repository root as the device runs them. The model directory
    matters: with a qwen2 config.json transformers loads SmolLM2's files as Qwen2's tokenizer
    class, which normalizes text (NFC) and so splits a few characters differently."""
    from quantlab.data import sampling, sources as data_sources
    from quantlab.models import sources
    from quantlab.recipe import load_recipe

    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        recipe = load_recipe(recipe_path, [f"model.id={model_dir}"])
        tokenizer = sources.load_tokenizer(recipe.model, sources.resolve(recipe.model))
        docs = data_sources.load_documents(recipe.calibration.dataset, "calibration.dataset", tokenizer)
        return sampling.sample(docs, tokenizer, recipe.calibration, recipe.seed).input_ids
    finally:
        os.chdir(cwd)


def draw_ids(model_dir: Path, out_dir: Path) -> dict[str, Any]:
    """Each quantlab recipe's calibration ids on `model_dir`, saved as CALIB's file names in
    `out_dir`, with their digests and whether they equal the prepared files."""
    import torch
    from safetensors.torch import load_file, save_file

    pc, _ = peers()
    out_dir.mkdir(parents=True, exist_ok=True)
    info = {}
    for row in ("quantlab-gptq", "quantlab-awq"):
        ids = sample_ids(RECIPES_DIR / ROWS[row][3], model_dir).contiguous()
        path = out_dir / CALIB[ids.shape[1]].name
        save_file({"input_ids": ids}, str(path))
        prepared = CALIB[ids.shape[1]]
        same = prepared.is_file() and torch.equal(load_file(str(prepared))["input_ids"], ids)
        info[path.name] = {"shape": list(ids.shape), "sha256": pc.sha256_file(path), "equal_to_prepared": same}
    return info


def draw_ids_cmd(args: argparse.Namespace) -> None:
    info = draw_ids(Path(args.model), Path(args.out_dir))
    write_json(Path(args.out_dir) / "ids.json", info)
    print(json.dumps(info, indent=2))


# --------------------------------------------------------------------------- build


def qwen2_config(shape: Shape, layers: int) -> dict[str, Any]:
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "torch_dtype": "bfloat16",
        "dtype": "bfloat16", "hidden_size": shape.hidden, "intermediate_size": shape.intermediate,
        "num_hidden_layers": layers, "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim, "vocab_size": shape.vocab, "max_position_embeddings": shape.max_positions,
        "rope_theta": shape.rope_theta, "rms_norm_eps": shape.rms_eps, "hidden_act": "silu",
        "initializer_range": 0.02, "tie_word_embeddings": False, "use_cache": True, "attention_dropout": 0.0,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": layers,
        "bos_token_id": 1, "eos_token_id": 2, "transformers_version": "5.17.0",
    }


def build_model(shape_name: str, layers: int, out: Path, seed: int = 0, device: str = "auto") -> dict[str, Any]:
    """Write a random-weight checkpoint of `layers` decoder layers one shard per layer, so host
    memory holds at most one layer (or the embedding); skip when `out` already holds it."""
    import torch
    from safetensors.torch import save_file

    shape = SHAPES[shape_name]
    spec = {"shape": shape_name, "layers": layers, "seed": seed, "std": 0.02, "dims": dataclasses.asdict(shape)}
    done = out / "build.json"
    if done.is_file() and json.loads(done.read_text()).get("spec") == spec:
        say(f"model {out} already built")
        return json.loads(done.read_text())
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    start = time.perf_counter()
    total = layers + 2
    weight_map: dict[str, str] = {}
    size = 0

    def tensor(name: str, dims: tuple[int, ...]) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.ones(dims, dtype=torch.bfloat16)
        gen = torch.Generator(device=dev).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        t = torch.empty(dims, dtype=torch.bfloat16, device=dev)
        rows = max(1, (1 << 26) // max(1, t[0].numel() if t.dim() > 1 else 1))  # ≤ 64M elements a chunk
        for r in range(0, dims[0], rows):
            t[r:r + rows].normal_(0.0, 0.02, generator=gen)
        return t.cpu()

    def shard(index: int, tensors: dict[str, tuple[int, ...]]) -> None:
        nonlocal size
        name = f"model-{index:05d}-of-{total:05d}.safetensors"
        made = {k: tensor(k, v) for k, v in tensors.items()}
        save_file(made, str(out / name), metadata={"format": "pt"})
        size += sum(t.numel() * t.element_size() for t in made.values())
        weight_map.update({k: name for k in made})

    shard(1, {"model.embed_tokens.weight": (shape.vocab, shape.hidden)})
    for i in range(layers):
        shard(i + 2, {f"model.layers.{i}.{k}": v for k, v in shape.layer_tensors().items()})
        say(f"built layer {i + 1}/{layers}")
    shard(total, {"model.norm.weight": (shape.hidden,), "lm_head.weight": (shape.vocab, shape.hidden)})
    write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": size}, "weight_map": weight_map})
    write_json(out / "config.json", qwen2_config(shape, layers))
    write_json(out / "generation_config.json", {"bos_token_id": 1, "eos_token_id": 2})
    for name in TOKENIZER_FILES:
        shutil.copy(TOKENIZER_DIR / name, out / name)
    info = {"spec": spec, "bytes": size, "seconds": round(time.perf_counter() - start, 1), "generated_on": str(dev),
            "peak_host_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    write_json(done, info)
    say(f"built {out}: {size / GiB:.2f} GiB in {info['seconds']} s on {dev}")
    return info


def build(args: argparse.Namespace) -> None:
    layers = args.layers or SHAPES[args.shape].layers
    print(json.dumps(build_model(args.shape, layers, Path(args.out), args.seed, args.build_device), indent=2))


# --------------------------------------------------------------------------- the device: foreground


def source_digest() -> str:
    digest = hashlib.sha256()
    for folder in ("quantlab", "kernels", "recipes", "calib_data"):
        for f in sorted((REPO / folder).rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts:
                digest.update(str(f.relative_to(REPO)).encode())
                digest.update(f.read_bytes())
    digest.update((REPO / "pyproject.toml").read_bytes())
    return digest.hexdigest()[:16]


def install(root: Path, site: Path, log) -> None:
    """The carried wheels into `site` and quantlab into `<root>/qsite`, each once per content."""
    install_wheels(site, log)
    install_quantlab(root / "qsite", log)


def install_wheels(site: Path, log) -> None:
    wheels = sorted(p.name for p in (REPO / ".whl").glob("*.whl"))
    marker = site / ".scale_wheels"
    if wheels and (not marker.is_file() or marker.read_text() != "\n".join(wheels)):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(site),
                        *[str(REPO / ".whl" / w) for w in wheels]], check=True, stdout=log, stderr=log)
        marker.write_text("\n".join(wheels))
    elif not wheels and not marker.is_file():
        say("WARNING: no .whl/ carried and no wheels installed: llm-compressor rows will fail")


def install_quantlab(qsite: Path, log) -> None:
    """quantlab from this working tree (kernels/ becomes quantlab.kernels), as peers_gpu_awq does."""
    marker, digest = qsite / ".scale_source", source_digest()
    if not marker.is_file() or marker.read_text() != digest:
        shutil.rmtree(qsite, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--no-index", "--target", str(qsite), str(REPO)], check=True, stdout=log, stderr=log)
        marker.write_text(digest)


def runner_alive(root: Path) -> int | None:
    pid_file = root / "runner.pid"
    if not pid_file.is_file():
        return None
    pid = int(pid_file.read_text().split()[0])
    try:
        os.kill(pid, 0)
    except OSError:
        return None
    stat = Path(f"/proc/{pid}/stat")
    if stat.is_file() and stat.read_text().split(")")[-1].split()[0] == "Z":
        return None
    return pid


def sync_out(root: Path, out: Path) -> None:
    """What the runner wrote so far into $OUT (flat: at most 8 files come back)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("scale_rows.json", "runner.log", "setup.log", "build.log"):
        src = root / "out" / name
        if src.is_file():
            shutil.copy(src, out / name)
    logs = sorted((root / "rows").glob("*/log.txt"), key=lambda p: p.stat().st_mtime)
    with (out / "row_logs.txt").open("w") as fh:
        for log in logs:
            fh.write(f"\n######## {log.parent.name}\n{log.read_text(errors='replace')[-120_000:]}")


def device(args: argparse.Namespace) -> None:
    root, site = Path(args.root), Path(args.site)
    out = Path(os.environ.get("OUT", root / "out_copy"))
    (root / "out").mkdir(parents=True, exist_ok=True)
    deadline = time.time() + args.wait
    with (root / "out" / "setup.log").open("a") as log:
        log.write(f"\n== {now()} {' '.join(sys.argv)}\n")
        log.flush()
        if not args.no_install:
            start = time.perf_counter()
            install(root, site, log)
            say(f"wheels and quantlab installed ({time.perf_counter() - start:.0f} s)")
    pid = runner_alive(root)
    if pid:
        say(f"runner {pid} still running ({(root / 'runner.pid').read_text().split(maxsplit=1)[1].strip()}); waiting")
    else:
        argv = [sys.executable, str(Path(__file__).resolve()), "rows", "--root", str(root), "--shape", args.shape,
                "--rows", args.rows, "--gpus", args.gpus, "--row-timeout", str(args.row_timeout),
                "--device", args.device, "--site", str(site)]
        if args.layers:
            argv += ["--layers", str(args.layers)]
        if args.redo:
            argv += ["--redo"]
        if args.keep:
            argv += ["--keep"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": ":".join(p for p in (str(root / "qsite"), str(site)) if Path(p).is_dir())}
        log = open(root / "out" / "runner.log", "ab")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        (root / "runner.pid").write_text(f"{proc.pid} {' '.join(argv[3:])}\n")
        say(f"runner {proc.pid} started: {' '.join(argv[2:])}")
    while time.time() < deadline and runner_alive(root):
        sync_out(root, out)
        time.sleep(min(10, max(0.5, deadline - time.time())))
    sync_out(root, out)
    print((root / "out" / "runner.log").read_text(errors="replace")[-3000:] if (root / "out" / "runner.log").is_file() else "")
    summary = root / "out" / "scale_rows.json"
    if summary.is_file():
        for r in json.loads(summary.read_text())["rows"]:
            print(f"{r['key']:45s} {r['status']:8s} quantize {r.get('quantize_s')} s, process {r.get('process_wall_s')} s "
                  f"{(r.get('error') or '')[:200]}")
    print("ROWS STILL RUNNING: run the same command again now" if runner_alive(root) else "DONE")


# --------------------------------------------------------------------------- the device: runner


def row_key(row: str, shape: str, layers: int, gpus: int) -> str:
    return f"{row}|{shape}|L{layers}|g{gpus}"


def gpu_info() -> dict[str, Any]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        out = []
    names = [line.split(",")[0].strip() for line in out]
    return {"gpu": names[0] if names else "cpu", "gpus_present": len(names), "nvidia_smi": out,
            "cpus": os.cpu_count(), "host": os.uname().nodename}


def versions() -> dict[str, str]:
    from importlib.metadata import version

    found = {"python": sys.version.split()[0]}
    for pkg in ("torch", "transformers", "accelerate", "safetensors", "llmcompressor", "compressed-tensors",
                "datasets", "quantlab"):
        try:
            found[pkg] = version(pkg)
        except Exception:
            found[pkg] = "not installed"
    return found


def quantlab_has_gpus_flag(env: dict[str, str]) -> bool:
    try:
        text = subprocess.run([sys.executable, "-m", "quantlab", "run", "--help"], capture_output=True, text=True,
                              env={**env, "COLUMNS": "200"}, cwd=REPO, timeout=300).stdout
    except subprocess.TimeoutExpired:
        return False
    return "--gpus" in text


class GpuPoller:
    """Peak memory.used per GPU (MiB) by nvidia-smi, sampled between the runner's waits."""

    def __init__(self) -> None:
        self.peak: dict[str, int] = {}
        self.ok = shutil.which("nvidia-smi") is not None

    def sample(self) -> None:
        if not self.ok:
            return
        try:
            text = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            return
        for line in text.strip().splitlines():
            idx, _, used = line.partition(",")
            if used.strip().isdigit():
                self.peak[idx.strip()] = max(self.peak.get(idx.strip(), 0), int(used))


def run_child(cmd: list[str], env: dict[str, str], log: Path, cwd: Path, timeout: float) -> dict[str, Any]:
    """Run `cmd` in a session of its own; its exit, wall time, the tree's peak RSS (wait4) and
    nvidia-smi's peaks. Killed with its whole group at `timeout`."""
    poller = GpuPoller()
    start = time.perf_counter()
    with log.open("ab") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        timed_out = False
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - start > timeout:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            poller.sample()
            time.sleep(1.0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    return {"rc": proc.returncode, "timed_out": timed_out, "wall_s": round(time.perf_counter() - start, 1),
            "ru_maxrss_bytes": usage.ru_maxrss * 1024, "nvidia_smi_peak_mib": poller.peak}


def rank_list(value: Any) -> list[int] | None:
    """A per-rank figure as a list: an int (one rank), a list, or a mapping rank → bytes."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return [int(value)]
    if isinstance(value, dict):
        return [int(v) for _, v in sorted(value.items(), key=lambda kv: str(kv[0]).zfill(4))
                if isinstance(v, (int, float))]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if isinstance(v, (int, float))]
    return None


GPU_PLAN_KEYS = ("peak_gpu_bytes_per_rank", "gpu_bytes_per_rank", "per_rank_gpu_bytes", "peak_gpu_bytes",
                 "gpu_peak_bytes", "gpu_bytes", "peak_device_bytes", "device_bytes", "total_gpu_bytes")
HOST_PLAN_KEYS = ("peak_host_bytes", "peak_host_rss_bytes", "host_peak_bytes", "host_bytes", "cpu_bytes")


def plan_bytes(plan: Any, keys: tuple[str, ...]) -> int | None:
    """The first of `keys` found in a memory plan (mapping, nested mappings or object); per-rank
    values give their largest."""
    if plan is None:
        return None
    for key in keys:
        value = plan.get(key) if isinstance(plan, dict) else getattr(plan, key, None)
        if callable(value):
            try:
                value = value()
            except Exception:
                value = None
        ranks = rank_list(value)
        if ranks:
            return max(ranks)
    if isinstance(plan, dict):
        for value in plan.values():
            if isinstance(value, dict):
                found = plan_bytes(value, keys)
                if found is not None:
                    return found
    return None


def jsonable(obj: Any, depth: int = 0) -> Any:
    if depth > 6:
        return repr(obj)[:200]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, dict):
        return {str(k): jsonable(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v, depth + 1) for v in obj[:200]]
    if callable(getattr(obj, "to_dict", None)):
        return jsonable(obj.to_dict(), depth + 1)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return jsonable(dataclasses.asdict(obj), depth + 1)
    if hasattr(obj, "model_dump"):
        return jsonable(obj.model_dump(mode="json"), depth + 1)
    if hasattr(obj, "__dict__"):
        return jsonable({k: v for k, v in vars(obj).items() if not k.startswith("_")}, depth + 1)
    return repr(obj)[:200]


def collect_quantlab(run_dir: Path, child: dict[str, Any], ids_file: Path) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    row: dict[str, Any] = {}
    cfg_path = run_dir / "quantized" / "quant_config.json"
    if not cfg_path.is_file():
        row["status"], row["error"] = "failed", f"exit {child.get('exit_code')}: no quantized/quant_config.json"
        return row
    cfg = json.loads(cfg_path.read_text())
    manifest = json.loads((run_dir / "manifest.json").read_text()) if (run_dir / "manifest.json").is_file() else {}
    stages = manifest.get("stages", {})
    own = load_file(str(run_dir / "calib" / "tokens.safetensors"))["input_ids"]
    same = torch.equal(own, load_file(str(ids_file))["input_ids"])
    prepared = CALIB[own.shape[1]]
    row.update(status="ok" if same else "failed", calib_identical=same,
               prepared_identical=prepared.is_file() and torch.equal(own, load_file(str(prepared))["input_ids"]),
               error=None if same else f"quantlab's calibration ids differ from {ids_file}",
               quantize_s=cfg.get("quantize_seconds"), quantize_s_source="quant_config.json quantize_seconds",
               stage_s=stages.get("quantize", {}).get("seconds"),
               calibration_s=stages.get("calibration", {}).get("seconds"),
               lazy_loading=cfg.get("lazy_loading"), quantized_linears=len(cfg.get("modules", {})),
               stage_peak_host_bytes=cfg.get("peak_host_rss_bytes", cfg.get("peak_host_bytes")))
    alloc = rank_list(cfg.get("peak_gpu_bytes_per_rank", cfg.get("peak_gpu_bytes")))
    reserved = rank_list(cfg.get("peak_gpu_reserved_bytes_per_rank", cfg.get("peak_gpu_reserved_bytes")))
    if alloc:
        row.update(peak_gpu_allocated_bytes=alloc, peak_gpu_reserved_bytes=reserved,
                   peak_gpu_source="quant_config.json (quantize stage, per rank)")
    else:
        torch_peaks = [p for p in child.get("torch_peaks", []) if p["allocated"]]
        row.update(peak_gpu_allocated_bytes=[p["allocated"] for p in torch_peaks] or None,
                   peak_gpu_reserved_bytes=[p["reserved"] for p in torch_peaks] or None,
                   peak_gpu_source="torch.cuda.max_memory_* in the quantlab process (whole run, this process's devices)")
    plan = cfg.get("memory_plan")
    if plan is not None:
        row["plan"] = {"source": "quant_config.json memory_plan", "gpu_bytes": plan_bytes(plan, GPU_PLAN_KEYS),
                       "host_bytes": plan_bytes(plan, HOST_PLAN_KEYS), "raw": jsonable(plan)}
    else:
        row["plan"] = child.get("plan") or {"source": None, "gpu_bytes": None}
    return row


def collect_llmcompressor(result_files: list[Path], child: dict[str, Any]) -> dict[str, Any]:
    ranks = [json.loads(p.read_text()) for p in result_files if p.is_file()]
    if not ranks:
        return {"status": "failed", "error": f"exit {child['rc']}: no result file"}
    bad = [r for r in ranks if r.get("status") != "ok"]
    row = {"status": "failed" if bad else "ok", "error": bad[0].get("error") if bad else None,
           "quantize_s": max(r.get("oneshot_s") or 0 for r in ranks) or None,
           "quantize_s_source": "oneshot wall time (slowest rank; model loaded before)",
           "load_s": max(r.get("load_s") or 0 for r in ranks) or None,
           "peak_gpu_allocated_bytes": [r.get("peak_gpu_allocated") for r in ranks],
           "peak_gpu_reserved_bytes": [r.get("peak_gpu_reserved") for r in ranks],
           "peak_gpu_source": "torch.cuda.max_memory_* in each rank (oneshot only)",
           "peak_host_rss_per_rank_bytes": [r.get("ru_maxrss_bytes") for r in ranks],
           "quantized_linears": ranks[0].get("quantized_linears"), "calib_identical": True,
           "config": ranks[0].get("config"), "rtn_fallback": ranks[0].get("rtn_fallback"),
           "tool_versions": ranks[0].get("versions"), "plan": {"source": None, "gpu_bytes": None}}
    if len(ranks) != max(1, child.get("ranks", 1)):
        row["status"], row["error"] = "failed", f"{len(ranks)} rank results of {child.get('ranks')}"
    return row


def rows(args: argparse.Namespace) -> None:
    """The runner: the model, then each requested row × GPU count, scale_rows.json after each."""
    root = Path(args.root)
    out_dir = root / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    summary_path = out_dir / "scale_rows.json"
    shape = SHAPES[args.shape]
    layers = args.layers or shape.layers
    wanted = [r for r in args.rows.split(",") if r]
    unknown = [r for r in wanted if r not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; rows: {', '.join(ROWS)}")
    gpu_counts = [int(g) for g in args.gpus.split(",") if g]
    dev = gpu_info()
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {"rows": [], "runs": []}
    summary.update(device=dev, versions=versions(), prepared=json.loads(PREPARED.read_text()) if PREPARED.is_file() else None)
    summary["runs"].append({"started": now(), "argv": sys.argv[1:]})
    by_key = {r["key"]: r for r in summary["rows"]}

    def save() -> None:
        summary["rows"] = list(by_key.values())
        write_json(summary_path, summary)

    model_dir = root / "models" / f"{args.shape}-L{layers}"
    need = shape.bf16_bytes(layers)
    if not (model_dir / "build.json").is_file():
        root.joinpath("models").mkdir(parents=True, exist_ok=True)
        if shutil.disk_usage(root).free < need + 20 * GiB:  # room for the run directories' outputs
            for other in (root / "models").iterdir():
                if other != model_dir:
                    say(f"disk: removing {other} to make room")
                    shutil.rmtree(other, ignore_errors=True)
    say(f"model {model_dir}: {args.shape}, {layers} of {shape.layers} layers, {need / GiB:.1f} GiB bf16")
    build_log = out_dir / "build.log"
    built = subprocess.run([sys.executable, str(Path(__file__).resolve()), "build", "--shape", args.shape,
                            "--layers", str(layers), "--out", str(model_dir), "--build-device",
                            "cpu" if args.device == "cpu" else "auto"],
                           stdout=build_log.open("ab"), stderr=subprocess.STDOUT, cwd=REPO)
    if built.returncode != 0:
        say(f"build failed (exit {built.returncode}): {build_log.read_text()[-2000:]}")
        raise SystemExit(1)
    summary.setdefault("models", {})[model_dir.name] = json.loads((model_dir / "build.json").read_text())
    save()

    qsite, site = root / "qsite", Path(args.site)
    pythonpath = ":".join(str(p) for p in (qsite, site) if p.is_dir())
    pc, _ = peers()
    base_env = pc.child_env({"QUANTLAB_CACHE": str(root / "qc"), "NCCL_NVLS_ENABLE": "0",
                             "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})
    if pythonpath:
        base_env["PYTHONPATH"] = pythonpath
    else:
        base_env.pop("PYTHONPATH", None)
    # The ids every row uses: drawn here by quantlab's own code on this model directory, with this
    # machine's transformers (quantlab's rows check their own draw against them; the peer reads them).
    ids_dir = root / "ids"
    drawn = subprocess.run([sys.executable, str(Path(__file__).resolve()), "draw-ids", "--model", str(model_dir),
                            "--out-dir", str(ids_dir)], env=base_env, cwd=REPO, capture_output=True, text=True)
    if drawn.returncode != 0:
        say(f"draw-ids failed: {drawn.stdout[-1000:]} {drawn.stderr[-3000:]}")
        raise SystemExit(1)
    summary["ids"] = json.loads((ids_dir / "ids.json").read_text())
    say("calibration ids: " + ", ".join(f"{k} {'= prepared' if v['equal_to_prepared'] else 'DIFFER from prepared'}"
                                        for k, v in summary["ids"].items()))
    save()
    gpus_flag = any(ROWS[r][0] == "quantlab" for r in wanted) and quantlab_has_gpus_flag(base_env)
    summary["quantlab_gpus_flag"] = gpus_flag
    say(f"quantlab run --gpus: {'yes' if gpus_flag else 'NO (rows with more than one GPU are skipped)'}")
    for row_id in wanted:
        tool, algorithm, seq_len, recipe_name, scheme = ROWS[row_id]
        for gpus in gpu_counts:
            key = row_key(row_id, args.shape, layers, gpus)
            old = by_key.get(key)
            if old and old.get("status") == "ok" and not args.redo:
                say(f"{key}: done before, skipped")
                continue
            row: dict[str, Any] = {"key": key, "row": row_id, "tool": tool, "algorithm": algorithm, "scheme": scheme,
                                   "shape": args.shape, "layers": layers, "full_layers": shape.layers, "gpus": gpus,
                                   "samples": SAMPLES, "seq_len": seq_len, "device": {k: dev[k] for k in ("gpu", "gpus_present")},
                                   "started": now(), "status": "running", "notes": []}
            by_key[key] = row
            present = dev["gpus_present"]
            if args.device == "cpu":  # the smoke test: quantlab's N processes over gloo; no peer ranks
                if gpus > 1 and tool != "quantlab":
                    row.update(status="skipped", error="more than one process on the CPU: quantlab rows only")
            elif gpus > present:
                row.update(status="skipped", error=f"{gpus} GPUs asked, {present} present")
            elif tool == "quantlab" and gpus > 1 and not gpus_flag:
                row.update(status="skipped", error="this quantlab's `run` has no --gpus option")
            if row["status"] == "skipped":
                say(f"{key}: skipped ({row['error']})")
                save()
                continue
            save()
            folder = root / "rows" / key.replace("|", "_")
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            env = {**base_env, "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(gpus)) if args.device != "cpu" else ""}
            if args.device == "cpu":
                env["QUANTLAB_DISTRIBUTED_BACKEND"] = "gloo"
            me = str(Path(__file__).resolve())
            if tool == "quantlab":
                run_dir, stats = folder / "run", folder / "child.json"
                cmd = [sys.executable, me, "child-quantlab", "--recipe", str(RECIPES_DIR / recipe_name), "--model",
                       str(model_dir), "--run-dir", str(run_dir), "--gpus", str(gpus), "--out", str(stats)]
                cmd += ["--gpus-flag"] if gpus_flag else []
                cmd += ["--set", "device=cpu"] if args.device == "cpu" else []
                cmd += [a for o in ROW_SETTINGS.get(row_id, []) for a in ("--set", o)]
            else:
                result = folder / "result.json"
                child_args = ["child-llmcompressor", "--model", str(model_dir), "--calib",
                              str(ids_dir / CALIB[seq_len].name), "--out", str(result)]
                cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}", me]
                       if gpus > 1 else [sys.executable, me]) + child_args
            say(f"{key}: {' '.join(cmd)[:400]}")
            (folder / "log.txt").write_text(f"$ {' '.join(cmd)}\n")
            child = run_child(cmd, env, folder / "log.txt", REPO, args.row_timeout)
            row.update(process_wall_s=child["wall_s"], peak_host_rss_bytes=child["ru_maxrss_bytes"],
                       peak_host_rss_source="getrusage ru_maxrss of the row's process tree (os.wait4)",
                       nvidia_smi_peak_mib=child["nvidia_smi_peak_mib"], exit_code=child["rc"], finished=now())
            try:
                if tool == "quantlab":
                    info = json.loads(stats.read_text()) if stats.is_file() else {}
                    row.update(collect_quantlab(run_dir, {**info, "exit_code": child["rc"]}, ids_dir / CALIB[seq_len].name))
                    row["child"] = {k: info.get(k) for k in ("exit_code", "ru_maxrss_self_bytes", "ru_maxrss_children_bytes",
                                                             "torch_peaks", "argv")}
                    if not args.keep:
                        for f in (run_dir / "quantized").glob("*.safetensors"):
                            f.unlink()
                else:
                    files = [result] if gpus == 1 else [result.with_suffix(f".rank{r}.json") for r in range(gpus)]
                    row.update(collect_llmcompressor(files, {**child, "ranks": gpus}))
            except Exception as exc:  # a row's collection failing must not stop the others
                row.update(status="failed", error=f"collect: {type(exc).__name__}: {exc}")
            if child["timed_out"]:
                row.update(status="timeout", error=f"stopped at --row-timeout {args.row_timeout} s")
            elif child["rc"] != 0 and row.get("status") == "ok":
                row.update(status="failed", error=f"exit {child['rc']}")
            if row["status"] != "ok" and not row.get("error"):
                row["error"] = f"exit {child['rc']}"
            if row["status"] != "ok":
                row["log_tail"] = (folder / "log.txt").read_text(errors="replace")[-1500:]
            save()
            say(f"{key}: {row['status']} quantize {row.get('quantize_s')} s, process {row['process_wall_s']} s, "
                f"GPU {row.get('peak_gpu_allocated_bytes')}, RSS {row['peak_host_rss_bytes'] / GiB:.1f} GiB "
                f"{row.get('error') or ''}")
    summary["runs"][-1]["finished"] = now()
    save()
    say("runner done")


# --------------------------------------------------------------------------- the device: children


def torch_peaks() -> list[dict[str, int]]:
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    return [{"device": i, "allocated": torch.cuda.max_memory_allocated(i), "reserved": torch.cuda.max_memory_reserved(i)}
            for i in range(torch.cuda.device_count())]


def plan_estimate(recipe_path: str, overrides: list[str], gpus: int) -> dict[str, Any]:
    """`quantlab.memory_plan.plan_for` on the run's recipe, where that module exists."""
    try:
        from quantlab.memory_plan import plan_for
    except ImportError as exc:
        return {"source": None, "gpu_bytes": None, "error": f"quantlab.memory_plan.plan_for not available ({exc})"}
    try:
        from quantlab.recipe import load_recipe

        recipe = load_recipe(recipe_path, overrides)
        params = inspect.signature(plan_for).parameters
        named = [n for n in ("gpus", "num_gpus", "world_size", "n_gpus") if n in params]
        kwargs: dict[str, Any] = {n: gpus for n in named}
        if "model_dir" in params:
            kwargs["model_dir"] = Path(recipe.model.id)
        saved = os.environ.get("WORLD_SIZE")
        if not named:  # plan_for reads the rank count from torchrun's WORLD_SIZE
            os.environ["WORLD_SIZE"] = str(gpus)
        try:
            plan = plan_for(recipe, **kwargs)
        finally:
            if not named:
                if saved is None:
                    os.environ.pop("WORLD_SIZE", None)
                else:
                    os.environ["WORLD_SIZE"] = saved
        return {"source": "quantlab.memory_plan.plan_for", "gpu_bytes": plan_bytes(plan, GPU_PLAN_KEYS),
                "host_bytes": plan_bytes(plan, HOST_PLAN_KEYS), "raw": jsonable(plan),
                "kwargs": {k: str(v) for k, v in kwargs.items()}, "world_size": gpus}
    except Exception as exc:
        return {"source": "quantlab.memory_plan.plan_for", "gpu_bytes": None, "error": f"{type(exc).__name__}: {exc}"}


def child_quantlab(args: argparse.Namespace) -> None:
    """`quantlab run` through quantlab's own CLI entry point, in this process, so that its torch
    peaks and rusage can be read after the CLI returns."""
    overrides = [f"model.id={args.model}", f"output.dir={args.run_dir}", *args.set]
    info: dict[str, Any] = {"plan": plan_estimate(args.recipe, overrides, args.gpus)}
    argv = ["run", args.recipe, *[a for o in overrides for a in ("--set", o)]]
    argv += ["--gpus", str(args.gpus)] if args.gpus_flag else []
    info["argv"] = argv
    print(f"quantlab {' '.join(argv)}", flush=True)
    from quantlab.cli import app

    code: Any = 0
    try:
        app(argv, prog_name="quantlab")
    except SystemExit as exc:
        code = exc.code
    info.update(exit_code=code if isinstance(code, int) else 1, torch_peaks=torch_peaks(),
                ru_maxrss_self_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                ru_maxrss_children_bytes=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
    write_json(Path(args.out), info)
    sys.exit(info["exit_code"])


def child_llmcompressor(args: argparse.Namespace) -> None:
    """llm-compressor's `oneshot` GPTQ on the prepared ids; under torchrun, its distributed oneshot
    (init_dist, rank 0 loads and shares the offloaded model, the dataset split across ranks)."""
    import torch
    from safetensors.torch import load_file

    distributed = "LOCAL_RANK" in os.environ
    rank = int(os.environ.get("RANK", 0))
    out = Path(args.out) if not distributed else Path(args.out).with_suffix(f".rank{rank}.json")
    result: dict[str, Any] = {"rank": rank, "distributed": distributed, "status": "failed"}
    try:
        from datasets import Dataset
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import GPTQModifier
        from transformers import AutoModelForCausalLM, AutoTokenizer

        result["versions"] = versions()
        if distributed:
            from compressed_tensors.offload import init_dist

            init_dist()
        if not torch.cuda.is_available():  # the CPU smoke test: peers_cpu's workaround
            sys.path.insert(0, str(peers()[0].PEER_SCRIPTS))
            from llmcompressor_run import cpu_only_workarounds

            result["workarounds"] = cpu_only_workarounds()
        ids = load_file(args.calib)["input_ids"].to(torch.int64)
        data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
        start = time.perf_counter()
        if distributed:
            from compressed_tensors.offload import load_offloaded_model

            with load_offloaded_model():
                model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, device_map="auto_offload")
        else:
            model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        result["load_s"] = round(time.perf_counter() - start, 2)
        modifier = GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"], actorder=args.actorder,
                                dampening_frac=0.01, block_size=128)
        result["config"] = repr(modifier)[:800]
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        if distributed:
            torch.distributed.barrier()
        start = time.perf_counter()
        oneshot(model=model, tokenizer=tokenizer, dataset=data, recipe=[modifier], num_calibration_samples=ids.shape[0],
                max_seq_length=ids.shape[1], shuffle_calibration_samples=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        result["oneshot_s"] = round(time.perf_counter() - start, 2)
        if torch.cuda.is_available():
            result["peak_gpu_allocated"] = torch.cuda.max_memory_allocated()
            result["peak_gpu_reserved"] = torch.cuda.max_memory_reserved()
        result["quantized_linears"] = sum(1 for m in model.modules() if hasattr(m, "weight_scale"))
        result["rtn_fallback"] = list(getattr(modifier, "_rtn_fallback_module_names", []) or [])[:20]
        if not result["quantized_linears"]:
            raise RuntimeError("oneshot left no quantized Linear (no weight_scale parameters)")
        result["status"] = "ok"
    except Exception as exc:  # recorded, not raised: the runner reads the file
        import traceback

        result["error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
        traceback.print_exc()
    result["ru_maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    write_json(out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "versions"}), flush=True)
    if distributed and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.exit(0 if result["status"] == "ok" else 1)


# --------------------------------------------------------------------------- report (here)


def load_rows(paths: list[Path]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Rows of every returned scale_rows.json (a directory: each such file under it), later
    files first for the same key and device, and each file's header."""
    files: list[Path] = []
    for p in paths:
        files += sorted(p.rglob("scale_rows.json")) if p.is_dir() else [p]
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    headers = []
    for f in files:
        payload = json.loads(f.read_text())
        headers.append({k: payload.get(k) for k in ("device", "versions", "runs", "models", "prepared", "ids",
                                                    "quantlab_gpus_flag")} | {"file": str(f)})
        for r in payload["rows"]:
            slot = (r["key"], r.get("device", {}).get("gpu", "?") + f"x{r.get('device', {}).get('gpus_present')}")
            if r.get("status") == "ok" or merged.get(slot, {}).get("status") != "ok":
                merged[slot] = r
    return list(merged.values()), headers


def fmt(value: Any, spec: str = ".1f", none: str = "—") -> str:
    return none if value is None else format(value, spec)


def gib(value: int | None) -> str:
    return fmt(None if value is None else value / GiB, ".1f")


def per_rank(row: dict[str, Any]) -> str:
    alloc, reserved = row.get("peak_gpu_allocated_bytes") or [], row.get("peak_gpu_reserved_bytes") or []
    if not alloc:
        smi = row.get("nvidia_smi_peak_mib") or {}
        return " / ".join(f"smi {v / 1024:.1f}" for _, v in sorted(smi.items())) or "—"
    cells = []
    for i, a in enumerate(alloc):
        r = reserved[i] if i < len(reserved) else None
        cells.append(f"{gib(a)} ({gib(r)})" if r else gib(a))
    smi = sorted((row.get("nvidia_smi_peak_mib") or {}).items())
    if len(alloc) < row["gpus"]:  # the tool reported fewer ranks than ran: nvidia-smi's for the rest
        cells[-1] += f" (rank{'s' if len(alloc) > 1 else ''} 0{'–' + str(len(alloc) - 1) if len(alloc) > 1 else ''})"
        cells += [f"smi {v / 1024:.1f}" for _, v in smi[len(alloc):row["gpus"]]]
    return " / ".join(cells)


def plan_error(row: dict[str, Any], measured_key: str) -> float | None:
    """The plan's GPU estimate against the measured peak (`peak_gpu_allocated_bytes`: what the
    plan counts, live tensors; or `peak_gpu_reserved_bytes`: that plus the allocator's cache)."""
    est = (row.get("plan") or {}).get("gpu_bytes")
    measured = max([b for b in row.get(measured_key) or [] if b] or [0])
    return round(100 * (est / measured - 1), 1) if est and measured else None


def derive(rows_: list[dict[str, Any]]) -> None:
    for r in rows_:
        r["s_per_layer"] = round(r["quantize_s"] / r["layers"], 2) if r.get("quantize_s") else None
        r["plan_error_pct"] = plan_error(r, "peak_gpu_allocated_bytes")
        r["plan_error_reserved_pct"] = plan_error(r, "peak_gpu_reserved_bytes")
        r["max_peak_gpu_reserved_bytes"] = max([b for b in r.get("peak_gpu_reserved_bytes") or [] if b] or [0]) or None


def group_key(r: dict[str, Any], *fields: str) -> tuple:
    return tuple(r.get(f) for f in fields)


def speedups(rows_: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each N-GPU row's wall time against the 1-GPU row of the same tool, algorithm, shape,
    layers and inputs."""
    ok = [r for r in rows_ if r["status"] == "ok" and r.get("quantize_s")]
    fields = ("tool", "algorithm", "shape", "layers", "samples", "seq_len")
    machine = lambda r: str(r.get("device"))  # noqa: E731
    one = {group_key(r, *fields): r for r in ok if r["gpus"] == 1}
    one.update({(*group_key(r, *fields), machine(r)): r for r in ok if r["gpus"] == 1})
    out = []
    for r in ok:  # the 1-GPU row of the same machine where there is one
        base = one.get((*group_key(r, *fields), machine(r))) or one.get(group_key(r, *fields))
        if r["gpus"] > 1 and base:
            out.append({"tool": r["tool"], "algorithm": r["algorithm"], "shape": r["shape"], "layers": r["layers"],
                        "gpus": r["gpus"], "wall_1gpu_s": base["quantize_s"], "wall_s": r["quantize_s"],
                        "speedup": round(base["quantize_s"] / r["quantize_s"], 2),
                        "efficiency_pct": round(100 * base["quantize_s"] / r["quantize_s"] / r["gpus"], 1)})
    return out


def versus_peer(rows_: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ok = [r for r in rows_ if r["status"] == "ok" and r.get("quantize_s")]
    fields = ("algorithm", "shape", "layers", "gpus", "samples", "seq_len")
    peers = {group_key(r, *fields): r for r in ok if r["tool"] == "llmcompressor"}
    out = []
    for r in ok:
        peer = peers.get(group_key(r, *fields))
        if r["tool"] == "quantlab" and peer:
            out.append({"row": r["row"], "algorithm": r["algorithm"], "shape": r["shape"], "layers": r["layers"],
                        "gpus": r["gpus"], "quantlab_s": r["quantize_s"], "llmcompressor_s": peer["quantize_s"],
                        "time_ratio": round(r["quantize_s"] / peer["quantize_s"], 3),
                        "quantlab_gpu_gib": round(r["max_peak_gpu_reserved_bytes"] / GiB, 2) if r["max_peak_gpu_reserved_bytes"] else None,
                        "llmcompressor_gpu_gib": round(peer["max_peak_gpu_reserved_bytes"] / GiB, 2) if peer["max_peak_gpu_reserved_bytes"] else None})
    return out


def extrapolate(rows_: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Full-depth figures from slices: with two or more layer counts, a least-squares line
    t = a + b·L (and the same for host RSS); with one, s/layer × full layers (the slice's fixed
    costs spread over its layers: errs high). GPU peaks are per layer: not extrapolated."""
    ok = [r for r in rows_ if r["status"] == "ok" and r.get("quantize_s")]
    fields = ("row", "shape", "gpus", "samples", "seq_len")
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in ok:
        groups.setdefault(group_key(r, *fields), []).append(r)
    out = []
    for key, members in groups.items():
        full = members[0]["full_layers"]
        if any(m["layers"] == full for m in members):
            continue
        by_layers = {m["layers"]: m for m in members}
        xs = sorted(by_layers)
        entry = dict(zip(fields, key)) | {"from_layers": xs, "full_layers": full}
        if len(xs) >= 2:
            entry["method"] = f"linear fit over L = {', '.join(map(str, xs))}"
            entry["wall_s"] = round(line_at([(x, by_layers[x]["quantize_s"]) for x in xs], full), 1)
            rss = [(x, by_layers[x].get("peak_host_rss_bytes")) for x in xs if by_layers[x].get("peak_host_rss_bytes")]
            entry["peak_host_rss_bytes"] = int(line_at(rss, full)) if len(rss) >= 2 else None
        else:
            m = by_layers[xs[0]]
            entry["method"] = f"s/layer of the {xs[0]}-layer slice × {full}"
            entry["wall_s"] = round(m["quantize_s"] / xs[0] * full, 1)
            entry["peak_host_rss_bytes"] = None
        entry["s_per_layer"] = round(entry["wall_s"] / full, 2)
        out.append(entry)
    return out


def line_at(points: list[tuple[int, float]], x: int) -> float:
    n = len(points)
    mx, my = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    b = sum((p[0] - mx) * (p[1] - my) for p in points) / sxx
    return my + b * (x - mx)


def report(args: argparse.Namespace) -> None:
    rows_, headers = load_rows([Path(p) for p in args.files])
    if not rows_:
        raise SystemExit("no rows in the given files")
    order = {name: i for i, name in enumerate(SHAPES)}
    rows_.sort(key=lambda r: (order.get(r["shape"], 99), r["layers"], r["algorithm"] != "gptq", r["tool"] != "quantlab",
                              r["gpus"]))
    derive(rows_)
    payload = {"benchmark": "scale", "generated": now(), "sources": headers, "rows": rows_,
               "speedups": speedups(rows_), "versus_llmcompressor": versus_peer(rows_), "extrapolated": extrapolate(rows_)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(payload))
    print(out.with_suffix(".md").read_text())


def markdown(payload: dict[str, Any]) -> str:
    rows_, headers = payload["rows"], payload["sources"]
    devices = sorted({f"{h['device']['gpu']} × {h['device']['gpus_present']}" for h in headers if h.get("device")})
    vers = next((h["versions"] for h in headers if h.get("versions")), {})
    drawn: dict[str, dict[str, Any]] = {}
    for h in headers:
        for name, v in (h.get("ids") or {}).items():
            drawn.setdefault(name, {"sha256": set(), "prepared": set()})
            drawn[name]["sha256"].add(v["sha256"][:12])
            drawn[name]["prepared"].add(v["equal_to_prepared"])
    calib = "; ".join(f"{k}: sha256 {', '.join(sorted(v['sha256']))}…, "
                      f"{'equal to' if v['prepared'] == {True} else 'NOT always equal to'} the ids prepared here"
                      for k, v in drawn.items())
    identical = {r["key"]: r.get("calib_identical") for r in rows_ if r["tool"] == "quantlab" and r["status"] == "ok"}
    gpus = sorted({h["device"]["gpu"] for h in headers if h.get("device")})
    lines = [f"# Quantize stage at scale: quantlab and llm-compressor on {', '.join(gpus)}", "",
             f"- machines (GPU × count): {', '.join(devices)}; versions: {', '.join(f'{k} {v}' for k, v in vers.items())}",
             "- models: Qwen2 shapes (`benchmarks/scale.py` SHAPES) with random bf16 weights (seed 0, std 0.02, "
             "norms 1), SmolLM2's tokenizer; `layers` < full: the first N layers (a slice)",
             "- calibration: WikiText-2 train slice, random windows (seed 0) drawn on each machine by quantlab's own "
             f"tokenizer loader and sampler on the built model (`draw-ids`): {calib}. quantlab's run drew exactly "
             f"these in {sum(1 for v in identical.values() if v)} of {len(identical)} finished quantlab rows; "
             "llm-compressor gets the 128 × 2048 set",
             "- wall s: quantlab's `quantize_seconds` (the quantize stage's layer loop with its writes, model load "
             "excluded); llm-compressor's `oneshot` (model loaded before; the slowest rank). s/layer = wall s / layers",
             "- peak GPU GiB per rank: allocated (reserved) by PyTorch's allocator; `smi` = nvidia-smi memory.used "
             "where the tool reported none. Host RSS: getrusage ru_maxrss of the row's process tree. Plan: quantlab's "
             "memory plan estimate per rank; error = estimate / peak allocated − 1 (against peak reserved in brackets)",
             "",
             "| row | shape | layers | GPUs | samples×seq | wall s | s/layer | peak GPU GiB per rank "
             "| peak host RSS GiB | plan estimate GiB | plan error % | status |",
             "|---|---|---:|---:|---|---:|---:|---|---:|---:|---|---|"]
    for r in rows_:
        status = r["status"] + (f": {r['error']}" if r.get("error") and r["status"] != "ok" else "")
        lines.append("| " + " | ".join([
            r["row"], r["shape"], f"{r['layers']}/{r['full_layers']}", str(r["gpus"]),
            f"{r['samples']}×{r['seq_len']}", fmt(r.get("quantize_s")), fmt(r.get("s_per_layer"), ".2f"),
            per_rank(r), gib(r.get("peak_host_rss_bytes")), gib((r.get("plan") or {}).get("gpu_bytes")),
            f"{fmt(r.get('plan_error_pct'), '+.1f')} ({fmt(r.get('plan_error_reserved_pct'), '+.1f')})", status.replace("|", "\\|")[:300]]) + " |")
    if payload["speedups"]:
        lines += ["", "## More GPUs against one", "",
                  "| tool | algorithm | shape | layers | GPUs | wall s, 1 GPU | wall s | speed-up | efficiency |",
                  "|---|---|---|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {s['tool']} | {s['algorithm']} | {s['shape']} | {s['layers']} | {s['gpus']} | "
                  f"{s['wall_1gpu_s']:.1f} | {s['wall_s']:.1f} | {s['speedup']:.2f}× | {s['efficiency_pct']:.0f} % |"
                  for s in payload["speedups"]]
    if payload["versus_llmcompressor"]:
        lines += ["", "## quantlab against llm-compressor (same GPUs, same ids)", "",
                  "| quantlab row | shape | layers | GPUs | quantlab s | llm-compressor s | time ratio | quantlab GPU GiB "
                  "| llm-compressor GPU GiB |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {v['row']} | {v['shape']} | {v['layers']} | {v['gpus']} | {v['quantlab_s']:.1f} | "
                  f"{v['llmcompressor_s']:.1f} | {v['time_ratio']:.2f} | {fmt(v['quantlab_gpu_gib'], '.1f')} | "
                  f"{fmt(v['llmcompressor_gpu_gib'], '.1f')} |" for v in payload["versus_llmcompressor"]]
    if payload["extrapolated"]:
        lines += ["", "## Extrapolated to the full depth (NOT measured)", "",
                  "From the slices' per-layer figures; peak GPU memory is one layer's and is not extrapolated.", "",
                  "| row | shape | GPUs | samples×seq | measured layers | full layers | extrapolated wall s "
                  "| extrapolated s/layer | extrapolated host RSS GiB | method |",
                  "|---|---|---:|---|---|---:|---:|---:|---:|---|"]
        lines += [f"| {e['row']} | {e['shape']} | {e['gpus']} | {e['samples']}×{e['seq_len']} | "
                  f"{', '.join(map(str, e['from_layers']))} | {e['full_layers']} | {e['wall_s']:.1f} | "
                  f"{e['s_per_layer']:.2f} | {gib(e.get('peak_host_rss_bytes'))} | {e['method']} |"
                  for e in payload["extrapolated"]]
    notes = []
    for r in rows_:
        bits = [f"scheme {r['scheme']}"]
        if r.get("stage_s") is not None:
            bits.append(f"quantize stage with model load {r['stage_s']:.1f} s")
        if r.get("load_s") is not None:
            bits.append(f"model load {r['load_s']:.1f} s")
        if r.get("process_wall_s") is not None:
            bits.append(f"process {r['process_wall_s']:.1f} s")
        if r.get("nvidia_smi_peak_mib"):
            bits.append("nvidia-smi peak " + ", ".join(f"GPU{k} {v / 1024:.1f} GiB" for k, v in sorted(r["nvidia_smi_peak_mib"].items())))
        if r.get("peak_gpu_source"):
            bits.append(f"GPU figures from {r['peak_gpu_source']}")
        plan = r.get("plan") or {}
        if plan.get("error"):
            bits.append(f"plan: {plan['error'][:160]}")
        if r.get("rtn_fallback"):
            bits.append(f"RTN fallback on {len(r['rtn_fallback'])} modules")
        notes.append(f"- `{r['key']}`: " + "; ".join(bits))
    commands = [" ".join(run["argv"]) for h in headers for run in (h.get("runs") or [])]
    lines += ["", "## Rows", "", *notes, "", "## Runner invocations", "", *[f"- `{c}`" for c in dict.fromkeys(commands)]]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("prepare", help="here: tokenizer, text, recipes, calibration ids (and --wheels)")
    s.add_argument("--wheels", action="store_true", help="also download the wheels into .whl/")
    s = sub.add_parser("build", help="a random-weight checkpoint, one layer at a time")
    s.add_argument("--shape", choices=list(SHAPES), required=True)
    s.add_argument("--layers", type=int, default=None, help="the first N layers (default: all)")
    s.add_argument("--out", required=True)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--build-device", default="auto", help="where the random numbers are drawn (auto: cuda if present)")
    for name in ("device", "rows"):
        s = sub.add_parser(name, help="on the device: setup, runner, copy results to $OUT" if name == "device"
                           else "the runner (device starts it in the background)")
        s.add_argument("--shape", choices=list(SHAPES), default="qwen2-7b")
        s.add_argument("--layers", type=int, default=None, help="the first N layers (default: all)")
        s.add_argument("--rows", default="quantlab-gptq,quantlab-awq,llmcompressor-gptq", help=", ".join(ROWS))
        s.add_argument("--gpus", default="1", help="comma-separated GPU counts, e.g. 1,2")
        s.add_argument("--row-timeout", type=float, default=3000)
        s.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the local smoke test")
        s.add_argument("--root", default=str(DEVICE_ROOT))
        s.add_argument("--site", default=str(SITE), help="where the carried wheels are installed")
        s.add_argument("--redo", action="store_true", help="run rows again that are done")
        s.add_argument("--keep", action="store_true", help="keep the quantized safetensors of quantlab's runs")
        if name == "device":
            s.add_argument("--wait", type=float, default=570, help="seconds to wait for the runner in this call")
            s.add_argument("--no-install", action="store_true", help="skip installing wheels and quantlab")
    s = sub.add_parser("child-quantlab")
    s.add_argument("--recipe", required=True)
    s.add_argument("--model", required=True)
    s.add_argument("--run-dir", required=True)
    s.add_argument("--gpus", type=int, default=1)
    s.add_argument("--gpus-flag", action="store_true", help="pass --gpus to quantlab run")
    s.add_argument("--set", action="append", default=[])
    s.add_argument("--out", required=True)
    s = sub.add_parser("child-llmcompressor")
    s.add_argument("--model", required=True)
    s.add_argument("--calib", required=True)
    s.add_argument("--actorder", default="static", help="GPTQModifier.actorder: static (= weight; its default) "
                   "or None; 0.14 refuses group")
    s.add_argument("--out", required=True)
    s = sub.add_parser("draw-ids", help="quantlab's calibration ids for the recipes on a model directory")
    s.add_argument("--model", required=True)
    s.add_argument("--out-dir", required=True)
    s = sub.add_parser("report", help="here: benchmarks/results/scale_nvidia_h200.{json,md} from returned files")
    s.add_argument("files", nargs="+", help="scale_rows.json files or directories holding them")
    s.add_argument("--out", default=str(RESULTS / "scale_nvidia_h200"), help="path without suffix")
    args = p.parse_args()
    if getattr(args, "actorder", "x") in ("None", "none", ""):
        args.actorder = None
    {"prepare": prepare, "build": build, "device": device, "rows": rows, "child-quantlab": child_quantlab,
     "child-llmcompressor": child_llmcompressor, "draw-ids": draw_ids_cmd, "report": report}[args.cmd](args)


if __name__ == "__main__":
    main()
