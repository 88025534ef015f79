"""The sequential layer-by-layer engine.

Capture the inputs of decoder layer 0 for every calibration batch (and what the model passes
each layer besides its hidden states: families such as Gemma 3 give sliding-window and global
layers different masks and RoPE tables), then for each layer:
onload it to the compute device, let each algorithm (in recipe order) observe and quantize
it, then write the fake-quantized weights (each Linear's last codes) back so the layer
computes what it will compute when deployed, recompute the layer's outputs as the next
layer's inputs, and offload it. Peak memory is one layer plus the calibration activations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatch
from typing import Any, Callable, Iterable, Protocol

import torch
from torch import nn

from quantlab.engine import distributed
from quantlab.engine.linear_error import LinearErrors, remove
from quantlab.models.arch import ArchSpec
from quantlab.models.moe import counting_routes
from quantlab.quant.primitives import QuantizedWeight


class _Captured(Exception):
    """Raised by the layer-0 hook to stop the forward once its inputs are recorded."""


class Batch:
    """One calibration batch as the current decoder layer takes it: `hidden` `[b, L, H]`, and
    `kwargs`, everything else the layer is called with. `layer_kwargs`: per decoder layer, what
    else it is called with (empty: every layer takes `kwargs`); layers of one kind share the very
    same tensors.

    An offloaded batch (`device` given; `calibration.offload: cpu`) keeps its tensors on the CPU,
    pinned where CUDA is available, and `hidden` / `kwargs` copy them to `device` at each read:
    the device then holds the batches being computed on, not every calibration activation.
    Readers see the same values either way (copies are exact); on a CPU run the copies are
    no-ops, so offloading changes nothing there."""

    def __init__(self, hidden: torch.Tensor, kwargs: dict[str, Any],
                 layer_kwargs: list[dict[str, Any]] | None = None, device: torch.device | None = None):
        self.device = device
        self.layer_kwargs = layer_kwargs if layer_kwargs is not None else []
        self._hidden, self._kwargs = hidden, kwargs
        if device is not None:
            memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # shared tensors stay shared
            self._hidden = _offload(hidden)
            self._kwargs = _offload_tree(kwargs, memo)
            self.layer_kwargs = [_offload_tree(k, memo) for k in self.layer_kwargs]

    @property
    def offloaded(self) -> bool:
        return self.device is not None

    @property
    def hidden(self) -> torch.Tensor:
        """`[b, L, H]` input of the current layer, on the compute device."""
        return self._hidden if self.device is None else self._hidden.to(self.device, non_blocking=True)

    @property
    def kwargs(self) -> dict[str, Any]:
        return self._kwargs if self.device is None else _to(self._kwargs, self.device)

    def for_layer(self, index: int, hidden: torch.Tensor | None = None,
                  device: torch.device | None = None) -> "Batch":
        """This batch (or `hidden` in its place) as the input of decoder layer `index`, read on
        `device`; an offloaded batch stays where it is."""
        kwargs = self.layer_kwargs[index] if self.layer_kwargs else self._kwargs
        hidden = self._hidden if hidden is None else hidden
        if self.offloaded:
            return Batch(hidden, kwargs, self.layer_kwargs, device or self.device)
        return Batch(hidden.to(device), _to(kwargs, device), self.layer_kwargs)

    def with_hidden(self, hidden: torch.Tensor) -> "Batch":
        """The next layer's input: `hidden` in place of this batch's, kept where this batch is."""
        return Batch(hidden, self._kwargs, self.layer_kwargs, self.device)

    def on(self, device: torch.device) -> "Batch":
        """This batch, without per-layer arguments, read on `device` (the head's input)."""
        if self.offloaded:
            return Batch(self._hidden, self._kwargs, device=device)
        return Batch(self._hidden.to(device), _to(self._kwargs, device))


# A forward over at most this many offloaded batches keeps its outputs on the device (AWQ's
# block objective compares them there, so its arithmetic does not depend on the offload); a
# longer one sends each output to the CPU as it is computed.
RESIDENT_BATCHES = 2


@dataclass
class LayerContext:
    """What an algorithm sees of one decoder layer."""

    index: int
    prefix: str
    layer: nn.Module
    spec: ArchSpec
    batches: list[Batch]
    device: torch.device
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)
    # Calibrated ranges (activation / KV absmax) keyed by layer-relative name, e.g.
    # `self_attn.q_proj.input_absmax`; the engine prefixes them with the layer's name.
    scales: dict[str, torch.Tensor] = field(default_factory=dict)
    # Per output channel, what a Linear's outputs were divided by when AWQ / SmoothQuant folded
    # scales into its rows (the next Linear takes them back); `LinearErrors` undoes it.
    output_scales: dict[str, torch.Tensor] = field(default_factory=dict)

    def linear(self, name: str) -> nn.Linear:
        return self.layer.get_submodule(name)

    def divided_outputs(self, name: str, s: torch.Tensor) -> None:
        """Record that `name`'s output channels were divided by `s` (if `name` is a Linear)."""
        if isinstance(self.layer.get_submodule(name), nn.Linear):
            prior = self.output_scales.get(name)
            self.output_scales[name] = s.detach().float() * (1 if prior is None else prior.to(s.device))

    def full_name(self, name: str) -> str:
        """A layer-relative module name as the model names it (the head's prefix is empty)."""
        return f"{self.prefix}.{name}" if self.prefix else name

    def forward(self) -> list[torch.Tensor]:
        """Run the layer over every calibration batch (hooks attached by callers observe it).
        Over more than `RESIDENT_BATCHES` offloaded batches, each output goes to the CPU as soon
        as it is computed, so the device holds only the batch in flight."""
        home = len(self.batches) > RESIDENT_BATCHES and any(b.offloaded for b in self.batches)
        keep = _offload if home else (lambda t: t)
        with torch.no_grad():
            return [keep(_layer_output(self.layer(b.hidden, **b.kwargs))) for b in self.batches]


class LayerAlgorithm(Protocol):
    """A quantization algorithm's adapter to the engine.

    `apply` may observe the layer (through `ctx.forward()`), change its float parameters
    (AWQ/SmoothQuant scale folding) and return canonical codes for some of its Linears.
    An algorithm with a true `data_free` attribute (RTN) never looks at activations; when
    every algorithm is data-free the engine runs no calibration forward at all. One with a true
    `rounds_in_place` (GPTQ) writes its rounding into the weights as it goes, so the float
    weights it rounded are the ones it started from.
    """

    def apply(self, ctx: LayerContext) -> dict[str, QuantizedWeight]: ...


class LayerStore(Protocol):
    """Where the engine gets each decoder layer from and gives it back: the model's own
    resident layers (`ResidentLayers`), or a checkpoint read one layer at a time
    (`quantlab.models.lazy.CheckpointLayers`)."""

    def load(self, index: int, device: torch.device) -> nn.Module: ...

    def release(self, index: int) -> None: ...


@dataclass
class ResidentLayers:
    """Layers already in host memory: moved to the compute device and back."""

    layers: nn.ModuleList

    def load(self, index: int, device: torch.device) -> nn.Module:
        return self.layers[index].to(device)

    def release(self, index: int) -> None:
        self.layers[index].to("cpu")


def is_ignored(full_name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch(full_name, p) for p in patterns)


def _layer_output(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(_to(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


def _offload(t: torch.Tensor) -> torch.Tensor:
    """`t` on the CPU (itself if it is there), pinned so copies back to the device are fast."""
    if t.device.type == "cpu":
        return t
    home = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    home.copy_(t)
    return home


def _offload_tree(obj: Any, memo: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """`_offload` over tensors in tuples and dicts; a tensor met twice (RoPE tables every layer
    of a kind shares) gets one copy. `memo` keeps each original alive so its id stays unique."""
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            memo[id(obj)] = (obj, _offload(obj))
        return memo[id(obj)][1]
    if isinstance(obj, tuple):
        return tuple(_offload_tree(o, memo) for o in obj)
    if isinstance(obj, dict):
        return {k: _offload_tree(v, memo) for k, v in obj.items()}
    return obj


class _Recorder(nn.Module):
    """Stands in for a decoder layer during capture: records what the model calls it with and
    passes the hidden states on unchanged, so no layer's weights are touched; the last one
    ends the forward."""

    def __init__(self, calls: list[tuple[torch.Tensor | None, dict[str, Any]]], last: bool,
                 keep: Callable[[torch.Tensor], torch.Tensor | None]):
        super().__init__()
        self.calls, self.last, self.keep = calls, last, keep  # keep: what to record of the hidden states

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        hidden = args[0] if args else kwargs.pop("hidden_states")
        kwargs = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "past_key_value")}
        self.calls.append((self.keep(hidden.detach()), {**kwargs, "use_cache": False}))
        if self.last:
            raise _Captured
        return hidden


def capture_layer0_inputs(
    model: nn.Module, spec: ArchSpec, input_ids: torch.Tensor, batch_size: int, device: torch.device,
    offload: bool = False,
) -> list[Batch]:
    """Run the model's embedding part on each batch and record what layer 0 receives, and what
    else every layer is called with (`Batch.layer_kwargs`). `offload`: offloaded batches, each
    batch's hidden states sent to the CPU as soon as they are recorded."""
    layers = spec.decoder_layers(model)
    originals = list(layers)
    calls: list[tuple[torch.Tensor | None, dict[str, Any]]] = []
    first = _offload if offload else (lambda t: t)  # later layers see the same hidden states
    for i in range(len(layers)):
        layers[i] = _Recorder(calls, last=i == len(layers) - 1, keep=first if i == 0 else lambda t: None)
    # Everything before layer 0 (embeddings, rotary) goes to the device; the layers stay put.
    moved = _move_non_layers(model, spec, device)
    try:
        with torch.no_grad():
            for start in range(0, input_ids.shape[0], batch_size):
                try:
                    model(input_ids[start : start + batch_size].to(device), use_cache=False)
                except _Captured:
                    pass
    finally:
        for i, layer in enumerate(originals):
            layers[i] = layer
        for module in moved:
            module.to("cpu")
    n = len(originals)
    return [Batch(calls[b * n][0], calls[b * n][1], [kwargs for _, kwargs in calls[b * n:(b + 1) * n]],
                  device if offload else None) for b in range(len(calls) // n)]


def _move_non_layers(model: nn.Module, spec: ArchSpec, device: torch.device) -> list[nn.Module]:
    if device.type == "cpu":
        return []
    layers = spec.decoder_layers(model)
    moved = []
    parent = model.get_submodule(spec.layers.rsplit(".", 1)[0])
    for child in parent.children():
        if child is not layers:
            child.to(device)
            moved.append(child)
    return moved


def run_sequential(
    model: nn.Module,
    spec: ArchSpec,
    input_ids: torch.Tensor,
    algorithms: list[LayerAlgorithm],
    device: torch.device,
    batch_size: int = 8,
    on_layer: Callable[[int, int], None] | None = None,
    scales: dict[str, torch.Tensor] | None = None,
    folded: dict[str, torch.Tensor] | None = None,
    head_algorithms: list[LayerAlgorithm] | None = None,
    errors: LinearErrors | None = None,
    routed: dict[str, list[int]] | None = None,
    layers_from: LayerStore | None = None,
    sink: Callable[[LayerContext], None] | None = None,
    offload: bool = False,
) -> dict[str, QuantizedWeight]:
    """Quantize every decoder layer in order; returns canonical codes keyed by full Linear name.
    Ranges the algorithms put in `ctx.scales` are added to `scales` (if given) under full names;
    `folded` (if given) receives each quantized Linear's float weight as the stage whose codes
    won rounded it (scales folded, clipped), in fp16 on the CPU. `head_algorithms` (if any) then
    quantize `lm_head` on the last layer's outputs (`quantize_head`). `errors` (if given) records
    each decoder Linear's output error (`LinearErrors`); data-free stages then still run one
    calibration batch through the layers to measure it. `routed` (if given) receives, per MoE
    experts module, the calibration tokens routed to each expert (in the quantized layer's
    forward that feeds the next layer). `layers_from` (default: the model's own layers, moved to
    `device` and back) supplies each decoder layer and takes it back once done (`LayerStore`).
    `sink` (if given) receives each finished block, the head included, before its layer is
    released, and the returned dict stays empty: the codes live in the sink (the canonical
    form written block by block), not in host memory. `offload`: keep the calibration
    activations on the CPU between uses (`Batch`; `calibration.offload: cpu`)."""
    head_algorithms = head_algorithms or []
    observe = not all(getattr(a, "data_free", False) for a in [*algorithms, *head_algorithms])
    track = errors is not None and input_ids.numel() > 0
    # each calibration process captures its share (`distributed`); the algorithms reduce what they observe
    ids = input_ids[distributed.share(input_ids.shape[0], batch_size)] if observe else input_ids
    if track and not observe:  # data-free stages: only the samples the error measurement reads
        ids = input_ids[: -(-errors.tokens // input_ids.shape[1])]
    batches = capture_layer0_inputs(model, spec, ids, batch_size, device, offload) if observe or track else []
    layers = spec.decoder_layers(model)
    steps = len(layers) + bool(head_algorithms)
    quantized: dict[str, QuantizedWeight] = {}
    store = layers_from or ResidentLayers(layers)
    for index in range(len(layers)):
        layer = store.load(index, device)
        batches = [b.for_layer(index, device=device) for b in batches]
        ctx = LayerContext(index, f"{spec.layers}.{index}", layer, spec, batches, device)
        if track:
            handles = errors.float_hooks(layer)
            with torch.no_grad():
                layer(batches[0].hidden, **batches[0].kwargs)
            remove(handles)
        _quantize_block(ctx, algorithms, folded)
        if observe or track:
            handles = errors.quantized_hooks(layer) if track else []
            with counting_routes(layer) as counts:
                batches = [b.with_hidden(out) for out, b in zip(ctx.forward(), batches)]
            remove(handles)
            if routed is not None:
                routed.update({ctx.full_name(name): c.tolist() for name, c in counts.items()})
            if track:
                errors.finish(ctx.prefix, ctx.quantized, ctx.output_scales)
        _collect(ctx, None if sink else quantized, scales)
        if sink:
            sink(ctx)
        store.release(index)
        if on_layer:
            on_layer(index + 1, steps)
    if head_algorithms:
        head = quantize_head(model, batches, head_algorithms, device, folded)
        _collect(head, None if sink else quantized, scales)
        if sink:
            sink(head)
        if on_layer:
            on_layer(steps, steps)
    return quantized


def final_hidden_states(model: nn.Module, spec: ArchSpec, input_ids: torch.Tensor, batch_size: int,
                        device: torch.device, layers_from: LayerStore | None = None) -> list[torch.Tensor]:
    """The last decoder layer's outputs for each batch of `input_ids`, computed layer by layer:
    every batch passes layer i before layer i + 1 is loaded, so with a lazily read checkpoint
    one layer is in memory at a time (the streamed float perplexity). Each layer is called as
    the model calls it (`capture_layer0_inputs`), so the outputs are the model's own."""
    batches = capture_layer0_inputs(model, spec, input_ids, batch_size, device)
    store = layers_from or ResidentLayers(spec.decoder_layers(model))
    for index in range(len(spec.decoder_layers(model))):
        layer = store.load(index, device)
        with torch.no_grad():
            batches = [b.with_hidden(_layer_output(layer(b.hidden, **b.kwargs)))
                       for b in (b.for_layer(index, device=device) for b in batches)]
        store.release(index)
    return [b.hidden for b in batches]


class Head(nn.Module):
    """The final norm and the output projection as one block whose module names are the
    model's (`model.norm`, `lm_head`), so algorithms quantize lm_head as a layer's Linear."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.model = nn.Module()
        self.model.norm = norm
        self.lm_head = lm_head

    def forward(self, hidden: torch.Tensor, **_: Any) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden))


def untie_lm_head(model: nn.Module) -> None:
    """Give lm_head its own copy of tied input embeddings (the embedding stays float while the
    head is quantized) and record the model as untied."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head.weight.data_ptr() == embed.weight.data_ptr():
        head.weight = nn.Parameter(embed.weight.detach().clone(), requires_grad=False)
    model.config.tie_word_embeddings = False


def quantize_head(model: nn.Module, batches: list[Batch], algorithms: list[LayerAlgorithm],
                  device: torch.device, folded: dict[str, torch.Tensor] | None) -> LayerContext:
    """Quantize lm_head with `algorithms`, observing the final norm's input (the last decoder
    layer's outputs, `batches`); tied embeddings are untied first."""
    from quantlab.models.arch import HEAD_SPEC

    untie_lm_head(model)
    head = Head(model.get_submodule(HEAD_SPEC.scaling[0].prev), model.get_output_embeddings()).to(device)
    batches = [b.on(device) for b in batches]
    ctx = LayerContext(-1, "", head, HEAD_SPEC, batches, device)
    _quantize_block(ctx, algorithms, folded)
    head.to("cpu")
    return ctx


def _quantize_block(ctx: LayerContext, algorithms: list[LayerAlgorithm],
                    folded: dict[str, torch.Tensor] | None) -> None:
    """Run the algorithms on one block in recipe order, then write the winning codes back."""
    rounded_from: dict[str, torch.Tensor] = {}
    for algorithm in algorithms:
        before = _linear_weights(ctx.layer) if folded is not None and \
            getattr(algorithm, "rounds_in_place", False) else None
        codes = algorithm.apply(ctx)
        if folded is not None:
            rounded_from.update({name: before[name] if before is not None else _half_cpu(ctx.linear(name))
                                 for name in codes})
        ctx.quantized.update(codes)
    # Write the codes back only once every stage ran (a later stage's codes win): a stage
    # after AWQ (rtn, gptq) must re-encode AWQ's rescaled float weights, not its rounding.
    if folded is not None:
        folded.update({ctx.full_name(name): rounded_from[name] for name in ctx.quantized})
    for name, qw in ctx.quantized.items():
        ctx.linear(name).weight.data.copy_(qw.dequantize().to(ctx.linear(name).weight.dtype))


def _collect(ctx: LayerContext, quantized: dict[str, QuantizedWeight] | None,
             scales: dict[str, torch.Tensor] | None) -> None:
    if quantized is not None:
        quantized.update({ctx.full_name(name): _cpu(qw) for name, qw in ctx.quantized.items()})
    if scales is not None:
        scales.update({ctx.full_name(name): t.detach().cpu() for name, t in ctx.scales.items()})


def _half_cpu(linear: nn.Module) -> torch.Tensor:
    return linear.weight.detach().half().cpu()


def _linear_weights(layer: nn.Module) -> dict[str, torch.Tensor]:
    return {name: _half_cpu(m) for name, m in layer.named_modules() if isinstance(m, nn.Linear)}


def _cpu(qw: QuantizedWeight) -> QuantizedWeight:
    return QuantizedWeight(qw.codes.cpu(), qw.scales.cpu(), qw.zeros.cpu(), qw.g_idx.cpu(), qw.scheme)
