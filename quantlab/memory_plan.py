"""The memory plan: peak GPU and host memory of a run, estimated from the model's config.json and
the recipe before anything is loaded, so a run that cannot fit fails at once in one line naming
what to change, instead of running out of memory layers into quantizing.

The estimate is a sum of named terms per phase; the peak is the largest phase. Notation: b = bytes
per weight of the model dtype, n = this rank's calibration samples, S = calibration.seq_len,
B = 8 samples per batch, H = hidden size, I = the widest MLP input, V = vocab size, "in" / "rows"
= a Linear's input width / the rows of the weights sharing its input (q, k, v stacked).

Quantize stage, per decoder layer on the compute device (`engine.sequential`):
  * base, in every phase of a layer: the layer's weights (MoE: every expert) in b; its codes
    (1 byte per weight, plus fp32 scales and uint8 zeros per group); `LinearErrors`' 1024-token
    fp32 input/output samples (its copies of the float weights wait on the host); the calibration inputs
    n·S·H·b (one batch B·S·H·b with `calibration.offload: cpu`) and RoPE cos/sin, 2·S·head_dim·b
    per batch;
  * forward (the engine's pass to the next layer): the layer outputs (n·S·H·b; one batch when
    offloaded: each goes to the CPU as computed) and one batch's intermediates
    B·S·(MLP_BUFFERS·I + HIDDEN_BUFFERS·H)·b (sdpa attention: no S×S scores); act_ranges and
    SmoothQuant add their observers' fp32 copy of one batch's widest input, B·S·I·4;
  * gptq, per true-sequential group: its Hessians (in² fp32 per input set) plus the larger of
    the observation pass and the solve. The pass holds sets of n·S·H·b: the inputs it starts
    from (the module inputs the previous pass recorded, or, offloaded, the device copy of every
    batch `gptq._observe` makes by reading all `b.hidden` at once) and those it records for the
    next pass; and one batch's input, B·S·in·(GPTQ_OBSERVE_COPIES·b + 4). The solve holds, beside the
    Hessian it consumes, the inverse's GPTQ_INVERSE_BUFFERS in² buffers or the sweep's
    GPTQ_SWEEP_BUFFERS in² plus GPTQ_WEIGHT_COPIES fp32 copies of the stacked weight, and the
    inputs recorded for the next pass;
  * awq: every input site's Gram (in² fp32, all alive for the layer) and the larger of the
    observation (a forward, AWQ_OBSERVE_COPIES fp32 copies of one batch's input, the outputs of
    the batches it chose) and the grid search (AWQ_WEIGHT_COPIES fp32 copies of the largest
    scaling group's stacked weight);
  * rtn / smoothquant: fp32 working copies of the largest Linear / scaling group.
Around the layers: the capture (embeddings on the device, every batch's layer-0 input unless
offloaded, one batch's embedding output) and, for a stage with `lm_head: true`, the head
(V·H·b, its codes, the algorithm's working set on [V, H], the last layer's outputs).

Evaluation (perplexity, with the divergence two models: float and fake-quant) on the device:
the fake-quant model read layer by layer from its canonical shards, the float one too when
`lazy` (each streamed model's non-layer weights, one layer and every window's last hidden
states), whole otherwise; one window's forward, and its logits S·V in b plus
LOGIT_FP32_COPIES fp32 copies per model (KL_FP32_COPIES more for the divergence). Not measured
yet, unlike the quantize stage.

Host: HOST_RUNTIME (Python, torch, transformers), the non-layer weights (embeddings, lm_head)
and one layer when read lazily (the whole model otherwise), a finished layer's codes while its
shard is written, the offloaded activations (inputs and outputs, pinned), and every quantized
weight in fp16 when a K-quant GGUF export needs the folded weights. Ranks of one run share one
host, so host terms count once per rank. On a CPU run device and host are one memory: the two
sides of a phase are added, a term both count (the layer, the non-layer weights) once.

Not counted: the CUDA context and cuBLAS/cuSOLVER workspaces (outside or small in PyTorch's
allocator), allocator fragmentation, eager attention's S×S scores, calibration token ids,
activation-range tables, the previous GPTQ group's last Hessian, ROUGE generation and verify.
MoE forwards are counted as if every token went through one expert of the widest width.
Each constant below is one tunable factor. Against `torch.cuda.max_memory_allocated` per phase on
an H200 (Qwen2-7B and -72B layer shapes, 128 × 2048 samples, bf16; GPTQ W4 g128, AWQ, act_ranges;
offload none and cpu) the estimates were within −3 % and +10 %.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from quantlab.errors import UserError

if TYPE_CHECKING:
    import torch

    from quantlab.models.arch import ArchSpec
    from quantlab.recipe import Recipe

GiB = 2**30
FP32 = 4
BATCH = 8  # samples per calibration batch (run_sequential's batch_size)
ERROR_TOKENS = 1024  # LinearErrors.tokens: what a data-free run still sends through each layer
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# the forward of one batch through a decoder layer, in the model dtype
MLP_BUFFERS = 3  # [B, S, I]: act(gate), up, act(gate)·up
HIDDEN_BUFFERS = 4  # [B, S, H]: residual, normed input, attention output, MLP output
EMBED_BUFFERS = 1  # [B, S, H] during the capture: the embedding output in flight
OBSERVER_FP32_COPIES = 1  # [B·S, I] fp32: a range observer's copy of the widest Linear input
# GPTQ (algorithms/gptq.py)
# in² fp32 besides the Hessian, which the solve consumes in place: inverse_hessian_cholesky's L,
# the eye and L⁻¹ (the flipped copy is gone by then; act_order's permuted copies before it)
GPTQ_INVERSE_BUFFERS = 3
GPTQ_SWEEP_BUFFERS = 1  # in² fp32 besides the Hessian during the column sweep: U
GPTQ_WEIGHT_COPIES = 6  # [rows, in] fp32: Wᵀ, Q, errors, and quantize()'s scales, quotient, rounding
# [B·S, in] copies in the model dtype of one batch's input to the observed Linears (the input and
# the op that produced it), beside the fp32 copy the Hessian adds
GPTQ_OBSERVE_COPIES = 2
# AWQ (algorithms/awq.py), SmoothQuant, RTN
AWQ_OBSERVE_COPIES = 2  # [B·S, in] fp32 per observed batch: x.float(), |x|
AWQ_WEIGHT_COPIES = 5  # [rows, in] fp32 in the grid search: W, W·s, Q(W·s), Q/s − W, (Q/s − W)·Gram
SMOOTHQUANT_WEIGHT_COPIES = 4  # [rows, in] fp32: weights, stacked, fake-quantized, scaled
RTN_WEIGHT_COPIES = 4  # [out, in] fp32 in quantize(): scales per column, w / s, its rounding, clamp
# evaluation
LOGIT_FP32_COPIES = 2  # [S, V] per model: logits.float(), log_softmax
KL_FP32_COPIES = 2  # [S, V] for the divergence: p and p·(log p − log q)
# host
EVAL_TOKENS = 300_000  # tokens of an evaluation stream at most (WikiText-2 test: ~290k with Qwen2's tokenizer)
HOST_RUNTIME = 3 * GiB // 2  # resident before any tensor: Python, torch with CUDA libraries, transformers
HOST_CODE_COPIES = 2  # a finished layer's codes and their encoded shard
FOLDED_BYTES = 2  # fp16 float weights kept for a K-quant export (`folded`)

MIN_SAVING = GiB // 10  # a remedy saving less is not worth naming
GPU_MEMORY_ENV, HOST_MEMORY_ENV = "QUANTLAB_GPU_MEMORY", "QUANTLAB_HOST_MEMORY"
SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}

Terms = dict[str, int]


# --------------------------------------------------------------------------- the plan


@dataclass
class Phase:
    """One moment of a run: what lives on the compute device and on the host then."""

    name: str
    gpu: Terms
    host: Terms

    def merged(self) -> Terms:
        """Both sides in one memory (a CPU run): a term both sides count is one set of tensors."""
        out = dict(self.host)
        for key, value in self.gpu.items():
            out[key] = max(out.get(key, 0), value)
        return out


@dataclass
class MemoryPlan:
    """Estimated peaks in bytes (GPU: per GPU; host: all ranks together); `gpu` / `host`: the
    terms of the phase that sets each peak, named in `gpu_phase` / `host_phase`."""

    gpu_bytes: int
    host_bytes: int
    gpu: Terms
    host: Terms
    gpu_phase: str
    host_phase: str
    device: str = "cuda"  # the compute device; "cpu": one memory, reported as host
    world_size: int = 1
    lazy: bool = True
    offload: bool = False
    # what the estimate was made from, so `check_fits` can price the remedies
    inputs: tuple[dict[str, Any], Any] | None = field(default=None, repr=False, compare=False)

    def render(self) -> str:
        """One line for the run's plan: the peaks and their largest terms."""
        host = f"host ~{gib(self.host_bytes)} GiB in {self.host_phase} ({_top(self.host)})"
        notes = [n for n, on in (("activations offloaded to the CPU", self.offload),
                                 (f"per GPU of {self.world_size}", self.world_size > 1),
                                 ("layers read lazily", self.lazy)) if on]
        tail = f" [{'; '.join(notes)}]" if notes else ""
        if self.on_cpu:
            return f"memory plan (CPU run): {host}{tail}"
        gpu = f"GPU ~{gib(self.gpu_bytes)} GiB peak in {self.gpu_phase} ({_top(self.gpu)})"
        return f"memory plan: {gpu}, {host}{tail}"

    @property
    def on_cpu(self) -> bool:
        return _is_cpu(self.device)

    def to_dict(self) -> dict[str, Any]:
        return {"gpu_bytes": self.gpu_bytes, "host_bytes": self.host_bytes, "gpu_phase": self.gpu_phase,
                "host_phase": self.host_phase, "gpu": dict(self.gpu), "host": dict(self.host),
                "device": self.device, "world_size": self.world_size, "lazy": self.lazy, "offload": self.offload}


def _is_cpu(device: str) -> bool:
    return device.split(":")[0] == "cpu"


def gib(n: int) -> str:
    return f"{n / GiB:.1f}"


def _top(terms: Terms, k: int = 3) -> str:
    biggest = sorted(terms.items(), key=lambda kv: -kv[1])[:k]
    return ", ".join(f"{name} {gib(v)}" for name, v in biggest) + " GiB"


def estimate(config: dict[str, Any], recipe: Recipe, world_size: int = 1, lazy: bool = True,
             device: str = "cuda") -> MemoryPlan:
    """Peak memory of running `recipe` on the model of `config` (its config.json) as one of
    `world_size` ranks; `lazy`: decoder layers read one at a time (else the whole model is
    loaded); `device`: the compute device ("cuda", "cuda:1"), or "cpu" where device and host
    are one memory."""
    shapes = _Shapes.of(config, recipe)
    offload = recipe.offload_activations and not _is_cpu(device)  # a no-op on a CPU run
    phases = _quantize_phases(shapes, recipe, world_size, lazy, offload) + _evaluate_phases(shapes, recipe, lazy)
    for phase in phases:
        phase.gpu = {k: v for k, v in phase.gpu.items() if v}
        phase.host = {k: v for k, v in phase.host.items() if v}
    inputs = ({"config": config, "world_size": world_size, "lazy": lazy, "device": device}, recipe)
    if _is_cpu(device):
        top = max(phases, key=lambda p: sum(p.merged().values()))
        merged = {k: v * world_size for k, v in top.merged().items()}  # ranks share the host
        return MemoryPlan(0, sum(merged.values()), {}, merged, "", top.name, device, world_size, lazy, False, inputs)
    for phase in phases:
        phase.host = {k: v * world_size for k, v in phase.host.items()}  # ranks share the host
    gpu = max(phases, key=lambda p: sum(p.gpu.values()))
    host = max(phases, key=lambda p: sum(p.host.values()))  # the same in every phase of a stage
    return MemoryPlan(sum(gpu.gpu.values()), sum(host.host.values()), gpu.gpu, host.host, gpu.name,
                      host.name.split(":")[0], device, world_size, lazy, offload, inputs)


# --------------------------------------------------------------------------- model shapes


@dataclass(frozen=True)
class _Shapes:
    """What the estimate reads of the model config and the recipe."""

    b: int  # bytes per weight, model dtype
    hidden: int
    vocab: int
    layers: int
    head_dim: int
    mlp_width: int  # widest MLP input (intermediate size; a MoE expert's or shared expert's)
    linears: dict[str, tuple[int, int]]  # one decoder layer's Linears, [out, in]
    spec: ArchSpec
    layer_params: int  # weights of one decoder layer: Linears, norms, biases, routers
    embed_params: int
    head_params: int  # lm_head when not tied to the embeddings (else 0)
    group_size: int | None  # of the first weight stage, for the codes' scales

    @classmethod
    def of(cls, config: dict[str, Any], recipe: Recipe) -> _Shapes:
        from quantlab.export.source import head_dim, linear_shapes, router_width
        from quantlab.models.arch import spec_for_config
        from quantlab.recipe import WEIGHT_KINDS

        spec = spec_for_config(config)
        if spec is None:
            raise ValueError(f"no ArchSpec for model_type {config.get('model_type')!r}")
        hidden, vocab, hd = int(config["hidden_size"]), int(config["vocab_size"]), head_dim(config)
        linears = linear_shapes(config, spec)
        extra = len(spec.norms) * hidden + 2 * len(spec.head_norms) * hd
        extra += sum(router_width(config, n) * hidden for n in spec.float_linears)
        if spec.qkv_bias:
            extra += sum(linears[n][0] for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"))
        stage = next((e.config for e in recipe.stages if e.kind in WEIGHT_KINDS), None)
        tied = bool(config.get("tie_word_embeddings", False))
        return cls(b=DTYPE_BYTES[recipe.model.dtype], hidden=hidden, vocab=vocab,
                   layers=int(config["num_hidden_layers"]), head_dim=hd,
                   mlp_width=max(i for name, (_, i) in linears.items() if name.endswith("down_proj")),
                   linears=linears, spec=spec, layer_params=sum(o * i for o, i in linears.values()) + extra,
                   embed_params=vocab * hidden, head_params=0 if tied else vocab * hidden,
                   group_size=stage.weights.group_size if stage is not None else None)

    @property
    def non_layer_params(self) -> int:
        return self.embed_params + self.head_params + self.hidden

    def codes(self, shapes: list[tuple[int, int]]) -> int:
        """Canonical codes of these Linears: uint8 codes, fp32 scales and uint8 zeros per group."""
        def one(out_f: int, in_f: int) -> int:
            groups = 1 if self.group_size is None else -(-in_f // self.group_size)
            return out_f * in_f + out_f * groups * (FP32 + 1) + in_f * 4
        return sum(one(o, i) for o, i in shapes)

    def input_sets(self) -> list[tuple[int, int]]:
        """(in, rows) of each set of Linears sharing one input (q/k/v; gate/up; each expert's)."""
        return [(self.linears[s[0]][1], sum(self.linears[n][0] for n in s)) for s in self.spec.input_sets]


# --------------------------------------------------------------------------- calibration


def rank_samples(n: int, world_size: int) -> int:
    """The largest share of `n` calibration samples one of `world_size` ranks gets: whole batches
    where there are enough of them (as `engine.distributed.share` splits), else samples."""
    if world_size <= 1:
        return n
    batches = -(-n // BATCH)
    if batches >= world_size:
        return min(n, -(-batches // world_size) * BATCH)
    return -(-n // world_size)


def _data_free(recipe: Recipe) -> bool:
    return all(e.kind == "rtn" for e in recipe.stages)


def _samples(recipe: Recipe, world_size: int) -> tuple[int, int]:
    """(samples this rank runs through the layers, their length); (0, 0) without calibration."""
    calib = recipe.calibration
    if calib is None:
        return 0, 0
    n = calib.num_samples
    if _data_free(recipe):  # only the samples the linear-error measurement reads
        n = min(n, -(-ERROR_TOKENS // calib.seq_len))
    return rank_samples(n, world_size), calib.seq_len


# --------------------------------------------------------------------------- quantize stage


def _quantize_phases(m: _Shapes, recipe: Recipe, world_size: int, lazy: bool, offload: bool) -> list[Phase]:
    n, seq = _samples(recipe, world_size)
    act_set, act_batch = n * seq * m.hidden * m.b, min(n, BATCH) * seq * m.hidden * m.b
    rope = -(-n // BATCH) * 2 * seq * m.head_dim * m.b  # cos and sin per batch, [1, S, head_dim] each
    host = _quantize_host(m, recipe, lazy, 2 * act_set + rope if offload else 0)
    capture = {"non-layer weights": (m.embed_params + m.hidden) * m.b,
               "calibration inputs": act_batch if offload else act_set, "rope tables": rope,
               "embedding forward": EMBED_BUFFERS * act_batch}
    phases = [Phase("quantize: capture", capture, host)]
    base = {"layer weights": m.layer_params * m.b, "layer codes": m.codes(list(m.linears.values())),
            "calibration inputs": act_batch if offload else act_set, "rope tables": 0 if offload else rope}
    if n:
        base["linear-error samples"] = sum(ERROR_TOKENS * (i + 2 * o) for o, i in m.linears.values()) * FP32
    forward = _forward(m, min(n, BATCH), seq)
    outputs = {"layer outputs": act_batch if offload else act_set}
    phases.append(Phase("quantize: forward", {**base, **outputs, **forward}, host))
    kinds = {e.kind: e.config for e in recipe.stages}
    if "gptq" in kinds:
        work = _gptq(m, min(n, BATCH) * seq, act_set, offload)
        phases.append(Phase("quantize: gptq", {**base, **work}, host))
    if "awq" in kinds:
        awq = kinds["awq"]
        batches = -(-awq.max_tokens // (BATCH * seq)) if n else 0  # whole batches covering max_tokens
        chosen = min(batches * BATCH, n) * seq * m.hidden * m.b  # their outputs stay on the device
        phases.append(Phase("quantize: awq", {**base, **_awq(m, forward, min(n, BATCH) * seq, chosen)}, host))
    observers = {"observer copies": OBSERVER_FP32_COPIES * min(n, BATCH) * seq * m.mlp_width * FP32}
    if "act_ranges" in kinds:
        phases.append(Phase("quantize: act_ranges", {**base, **outputs, **forward, **observers}, host))
    if "smoothquant" in kinds:
        rows, in_f = _largest_group(m)
        work = {"smoothquant working copies": SMOOTHQUANT_WEIGHT_COPIES * rows * in_f * FP32}
        phases.append(Phase("quantize: smoothquant", {**base, **outputs, **forward, **observers, **work}, host))
    if "rtn" in kinds:
        out_f, in_f = max(m.linears.values(), key=lambda s: s[0] * s[1])
        phases.append(Phase("quantize: rtn", {**base, "rtn working copies": RTN_WEIGHT_COPIES * out_f * in_f * FP32},
                            host))
    head = [e.kind for e in recipe.stages if getattr(e.config, "lm_head", False)]
    if head:
        resident = act_batch if offload else act_set
        phases.append(Phase("quantize: lm_head", _head(m, head, resident, act_set if offload else 0), host))
    return phases


def _forward(m: _Shapes, batch: int, seq: int) -> Terms:
    """One batch's intermediates in a decoder layer's forward (sdpa attention: no S×S scores)."""
    return {"forward intermediates": batch * seq * (MLP_BUFFERS * m.mlp_width + HIDDEN_BUFFERS * m.hidden) * m.b}


def _solve(m: _Shapes, in_f: int, rows: int) -> int:
    """One input set's GPTQ solve beside its Hessian: the inverse's buffers or the sweep's (one
    in² buffer and fp32 copies of the stacked weight), and the stacked weight itself."""
    inverse = GPTQ_INVERSE_BUFFERS * in_f * in_f
    sweep = GPTQ_SWEEP_BUFFERS * in_f * in_f + GPTQ_WEIGHT_COPIES * rows * in_f
    return max(inverse, sweep) * FP32 + rows * in_f * m.b


def _gptq(m: _Shapes, batch_tokens: int, act_set: int, offload: bool) -> Terms:
    """The largest true-sequential group: its Hessians, plus the larger of its observation pass
    and its solves. A pass holds the inputs it starts from (those the previous pass recorded;
    offloaded, the device copy of every batch `_observe` makes when it starts at the layer) and
    those it records for the next pass (one set each), and one batch's input in flight; the
    solves keep what was recorded for the next pass."""
    sets = dict(zip(m.spec.input_sets, m.input_sets()))
    groups = [[n for n in group if n in m.linears] for group in m.spec.sequential]
    groups = [g for g in groups if g]
    best: Terms = {}
    for index, names in enumerate(groups):
        members = [sets[s] for s in sets if s[0] in names]
        starts = index > 0 and _records(groups[index - 1], names)  # from the previous pass's recording
        records = index + 1 < len(groups) and _records(names, groups[index + 1])
        widest = max(i for i, _ in members)
        observe = {"gptq observed inputs": act_set * ((starts or offload) + records),
                   "gptq observation": (GPTQ_OBSERVE_COPIES * m.b + FP32) * batch_tokens * widest}
        solve = {"gptq recorded inputs": act_set * records, "gptq solve": max(_solve(m, i, r) for i, r in members)}
        work = max(observe, solve, key=lambda t: sum(t.values()))
        terms = {"gptq hessians": sum(i * i for i, _ in members) * FP32, **work}
        if sum(terms.values()) > sum(best.values()):
            best = terms
    return best


def _records(names: list[str], following: list[str]) -> bool:
    """Whether GPTQ's pass over `names` records the inputs of the module holding `following`
    (`gptq._observe`): it does when that module is entered before any of `names` runs, i.e. when
    it holds them too (the attention for q/k/v → o; the MLP for gate/up → down)."""
    from quantlab.algorithms.gptq import common_parent

    parent = common_parent(following)
    return bool(parent) and all(n.startswith(parent + ".") for n in names)


def _awq(m: _Shapes, forward: Terms, batch_tokens: int, chosen: int) -> Terms:
    """Every input site's Gram, then the larger of the observation and the grid search."""
    grams = sum(i * i + i for i, _ in m.input_sets()) * FP32
    widest = max(i for i, _ in m.input_sets())
    observe = AWQ_OBSERVE_COPIES * batch_tokens * widest * FP32 + chosen + sum(forward.values())
    rows, in_f = _largest_group(m)
    search = AWQ_WEIGHT_COPIES * rows * in_f * FP32
    return {"awq grams": grams, "awq search" if search >= observe else "awq observation": max(search, observe)}


def _largest_group(m: _Shapes) -> tuple[int, int]:
    """(rows, in) of the largest stacked weight of one scaling group (gate/up; q/k/v)."""
    best = (0, 0)
    for group in m.spec.scaling:
        names = [n for n in group.linears if n in m.linears]
        if names:
            size = (sum(m.linears[n][0] for n in names), m.linears[names[0]][1])
            best = max(best, size, key=lambda s: s[0] * s[1])
    return best


def _head(m: _Shapes, kinds: list[str], resident: int, copies: int) -> Terms:
    """lm_head quantized on the last layer's outputs (`quantize_head`): `resident` of them on the
    device, and the `copies` GPTQ's observation makes of offloaded ones."""
    v, h = m.vocab, m.hidden
    terms = {"lm_head weights": (v * h + h) * m.b, "lm_head codes": m.codes([(v, h)]), "calibration inputs": resident}
    if "gptq" in kinds:  # the observation's copies are gone by the solve
        terms["gptq hessians"] = h * h * FP32
        solve = _solve(m, h, v)
        terms.update({"gptq solve": solve} if solve >= copies else {"gptq observed inputs": copies})
    else:
        terms["rtn working copies"] = RTN_WEIGHT_COPIES * v * h * FP32
    return terms


def _quantize_host(m: _Shapes, recipe: Recipe, lazy: bool, offloaded: int) -> Terms:
    from quantlab.formats import keeps_folded_weights

    one_layer = m.layer_params * m.b
    host = {"runtime": HOST_RUNTIME, "non-layer weights": m.non_layer_params * m.b, "layer weights": one_layer}
    if not lazy:
        host["other layers"] = (m.layers - 1) * one_layer
    host["layer codes"] = HOST_CODE_COPIES * m.codes(list(m.linears.values()))
    host["linear-error weights"] = sum(o * i for o, i in m.linears.values()) * m.b  # float copies, CPU
    if offloaded:
        host["offloaded activations"] = offloaded
    if keeps_folded_weights(recipe.export):
        host["folded weights"] = m.layers * sum(o * i for o, i in m.linears.values()) * FOLDED_BYTES
    return host


# --------------------------------------------------------------------------- evaluation


def _evaluate_phases(m: _Shapes, recipe: Recipe, lazy: bool) -> list[Phase]:
    ppl = recipe.evaluate.perplexity
    if ppl is None:
        return []
    kld = ppl.baseline and ppl.kl_divergence
    models = 2 if kld else 1
    # the fake-quant model is always read layer by layer (its canonical shards); the float one
    # when its checkpoint is lazy, else whole
    whole = 0 if lazy else int(kld)
    weights = {"non-layer weights": models * m.non_layer_params * m.b, "layer weights": models * m.layer_params * m.b}
    if whole:
        weights["other layers"] = whole * (m.layers - 1) * m.layer_params * m.b
    tokens = ppl.max_windows * ppl.seq_len if ppl.max_windows else EVAL_TOKENS
    windows = min(tokens, EVAL_TOKENS) * m.hidden * m.b  # each streamed model's last hidden states
    streamed = {"window hidden states": (models - whole) * windows}
    logits = ppl.seq_len * m.vocab * (models * (m.b + LOGIT_FP32_COPIES * FP32) + kld * KL_FP32_COPIES * FP32)
    gpu = {**weights, **streamed, "logits": logits, **_forward(m, 1, ppl.seq_len)}
    return [Phase("evaluate", gpu, {"runtime": HOST_RUNTIME, **weights})]


# --------------------------------------------------------------------------- capacity and the check


def parse_size(text: str, what: str) -> int:
    """`500MB`, `2GB`, `1.5GiB` or a byte count → bytes; `what` names the option or variable in
    the one-line error."""
    t = text.strip().lower()
    num = t.rstrip("kmgib")
    try:
        value = float(num) * SIZE_UNITS[t[len(num):]]
    except (ValueError, KeyError):
        raise UserError(f"{what} {text!r}: expected a size such as 500MB, 2GB or 1GiB") from None
    if value < 1:
        raise UserError(f"{what} {text!r}: must be positive")
    return int(value)


def _env_size(name: str) -> int | None:
    value = os.environ.get(name)
    return parse_size(value, name) if value else None


def capacity_overrides() -> tuple[int | None, int | None]:
    """`QUANTLAB_GPU_MEMORY` and `QUANTLAB_HOST_MEMORY` in bytes (None: unset); a bad value is a
    one-line UserError naming the variable."""
    return _env_size(GPU_MEMORY_ENV), _env_size(HOST_MEMORY_ENV)


def host_available() -> int | None:
    """Host memory a new allocation can have: psutil's or /proc/meminfo's MemAvailable, capped
    by a cgroup v2 limit (containers, batch jobs) where one is set: inside a container
    MemAvailable describes the whole machine."""
    try:
        import psutil

        available: int | None = psutil.virtual_memory().available
    except ImportError:
        available = _meminfo_available()
    limit = _cgroup_limit()
    if available is None or limit is None:
        return available if limit is None else limit
    return min(available, limit)


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_limit() -> int | None:
    """This cgroup's memory limit (not limit − usage: usage counts reclaimable page cache)."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        return None if limit == "max" else int(limit)
    except (OSError, ValueError):
        return None


def device_capacity(device: torch.device | str) -> tuple[int | None, int | None]:
    """(GPU bytes free on `device`, host bytes available); None where unknown, and GPU None on a
    CPU run. `QUANTLAB_GPU_MEMORY` / `QUANTLAB_HOST_MEMORY` (e.g. `16GiB`) override the
    measurement: a shared GPU, a job's budget, tests."""
    import torch

    device = torch.device(device)
    gpu_env, host_env = capacity_overrides()
    gpu = None
    if device.type == "cuda":
        gpu = gpu_env if gpu_env is not None else torch.cuda.mem_get_info(device)[0]
    return gpu, host_env if host_env is not None else host_available()


def check_fits(plan: MemoryPlan, capacity: tuple[int | None, int | None]) -> None:
    """Raise a one-line UserError when the plan's GPU or host peak exceeds `capacity`, naming the
    recipe changes that would lower it."""
    gpu, host = capacity
    if not plan.on_cpu and gpu is not None and plan.gpu_bytes > gpu:
        raise UserError(_overflow(plan, "gpu", gpu))
    if host is not None and plan.host_bytes > host:
        raise UserError(_overflow(plan, "host", host))


def _need(plan: MemoryPlan, side: str) -> int:
    return plan.gpu_bytes if side == "gpu" else plan.host_bytes


def _overflow(plan: MemoryPlan, side: str, available: int) -> str:
    phase = plan.gpu_phase if side == "gpu" else plan.host_phase
    where = {"gpu": plan.device, "host": "the host"}[side]
    if side == "host" and plan.on_cpu:
        where = "the host (CPU run)"
    remedies = _remedies(plan, side, available)
    terms = plan.gpu if side == "gpu" else plan.host
    tail = _join(remedies) if remedies else (f"no single recipe setting lowers it (largest: {_top(terms, 1)}); "
                                             f"free memory or use a larger {'GPU' if side == 'gpu' else 'machine'}")
    return (f"memory plan: {phase.split(':')[0]} needs ~{gib(_need(plan, side))} GiB on {where} but "
            f"{gib(available)} GiB is available; {tail}")


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + ", or " + items[-1]


def _variant(plan: MemoryPlan, change: Callable[[Any], None] | None = None, **overrides: Any) -> MemoryPlan:
    """The plan re-estimated with the recipe changed by `change` and/or other estimate arguments."""
    assert plan.inputs is not None
    args, recipe = plan.inputs
    if change is not None:
        recipe = recipe.model_copy(deep=True)
        change(recipe)
    return estimate(args["config"], recipe, **{k: v for k, v in args.items() if k != "config"} | overrides)


def _remedies(plan: MemoryPlan, side: str, available: int) -> list[str]:
    """The recipe changes that lower this side's peak, each with what it saves or what fits."""
    if plan.inputs is None:
        return []
    recipe = plan.inputs[1]
    need = _need(plan, side)
    out = []
    calib = recipe.calibration
    if calib is not None and not plan.on_cpu:
        wanted = "cpu" if side == "gpu" else "none"
        if calib.offload != wanted:
            saving = need - _need(_variant(plan, lambda r: setattr(r.calibration, "offload", wanted)), side)
            if saving >= MIN_SAVING:
                out.append(f"set calibration.offload: {wanted} (saves {gib(saving)} GiB)")
    if calib is not None and not _data_free(recipe):
        fits = _most_samples(plan, side, available)
        if fits is not None:
            out.append(f"lower calibration.num_samples to {fits} or fewer")
        elif need - _need(_variant(plan, lambda r: setattr(r.calibration, "num_samples", 1)), side) >= MIN_SAVING:
            out.append("lower calibration.num_samples")
    if side == "gpu" and calib is not None:
        gpus = next((n for n in (2, 4, 8) if n > plan.world_size and
                     _variant(plan, world_size=n).gpu_bytes <= available), None)
        if gpus is not None:
            out.append(f"use more GPUs (--gpus {gpus})")
    ppl = recipe.evaluate.perplexity
    if ppl is not None and ppl.baseline and ppl.kl_divergence:
        saving = need - _need(_variant(plan, lambda r: setattr(r.evaluate.perplexity, "kl_divergence", False)), side)
        if saving >= MIN_SAVING:
            out.append(f"set evaluate.perplexity.kl_divergence: false (one model at a time, saves {gib(saving)} GiB)")
    if not plan.lazy and _need(_variant(plan, lazy=True), side) <= available:
        out.append("give the model as a safetensors checkpoint (read one layer at a time)")
    return out


def _most_samples(plan: MemoryPlan, side: str, available: int) -> int | None:
    """The most calibration samples (below the recipe's) with which this side fits; None if none does."""
    current = plan.inputs[1].calibration.num_samples

    def fits(n: int) -> bool:
        return _need(_variant(plan, lambda r: setattr(r.calibration, "num_samples", n)), side) <= available

    if current <= 1 or not fits(1):
        return None
    lo, hi = 1, current - 1  # fits(lo); find the largest n ≤ hi that fits (the peak grows with n)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


# --------------------------------------------------------------------------- a recipe's plan


def world_size() -> int:
    """Ranks of this run (torchrun's `WORLD_SIZE`; 1 for a single process)."""
    return max(1, int(os.environ.get("WORLD_SIZE", "1") or 1))


def plan_for(recipe: Recipe, device: torch.device | str | None = None,
             model_dir: Path | None = None) -> MemoryPlan | None:
    """The recipe's memory plan on `device` (default: the recipe's device as a run would pick
    it), or None where the model's config.json is not on disk or lacks the sizes."""
    import torch

    from quantlab.models.sources import config_on_disk

    path = config_on_disk(recipe.model, model_dir)
    if path is None:
        return None
    if device is None:
        device = "cuda" if recipe.device == "cuda" or (recipe.device == "auto" and torch.cuda.is_available()) else "cpu"
    # read one layer at a time where the checkpoint is safetensors (a hub model's download is)
    lazy = recipe.model.gguf_file is None and ("huggingface" in str(path) or _has_safetensors(path.parent))
    try:
        config = json.loads(path.read_text())
        return estimate(config, recipe, world_size(), lazy, str(torch.device(device)))
    except (KeyError, TypeError, ValueError, ArithmeticError):
        return None  # an unknown family or a config without the sizes: no plan, the run decides


def _has_safetensors(directory: Path) -> bool:
    from quantlab.models.lazy import INDEX

    return (directory / "model.safetensors").is_file() or (directory / INDEX).is_file()


def announce(recipe: Recipe, device: torch.device | None, model_dir: Path | None = None,
             say: Callable[[str], None] | None = None, note: bool = True) -> MemoryPlan | None:
    """Estimate the recipe's memory, refuse it in one line when it does not fit `device` (None:
    not known here, not checked), then print the plan's line with `say`. None when there is no
    config to plan from; `note`: say so in a dim line."""
    from quantlab.progress import console

    say = say or console.print
    capacity_overrides()  # a bad size variable is refused even where nothing is checked
    capacity = device_capacity(device) if device is not None else None
    plan = plan_for(recipe, device, model_dir)
    if plan is None:
        if note:
            console.print("[dim]memory plan: skipped (the model's config.json is not on disk without a "
                          "download, or lacks the sizes)[/dim]")
        return None
    if capacity is not None:
        check_fits(plan, capacity)
    say(plan.render())
    return plan
