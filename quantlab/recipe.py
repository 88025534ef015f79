"""The recipe: one YAML file that names the model, data, stages, evaluation and outputs.

Parsed with a bounded `yaml.SafeLoader` (`parse_yaml`: no duplicate keys, bounded size, depth
and alias expansion) into strict pydantic models (unknown keys are errors). Every
error becomes one line naming the YAML path (`stages[0].rtn.weights.group_size`), the bad
value and what is allowed. CLI overrides (`--set calibration.num_samples=64`) are applied to
the raw mapping first, so they go through exactly the same validation.
"""

from __future__ import annotations

import re
import reprlib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from quantlab.errors import UserError
from quantlab.formats import HEAD_FORMATS, ExportFormat
from quantlab.quant.scheme import PRESETS, ActivationScheme, KVCacheScheme, WeightScheme


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("*")
    @classmethod
    def _clean_strings(cls, value: Any) -> Any:
        """No NUL byte or lone surrogate in any text (they end up in paths, hub ids, file names
        and logs, where they fail far from the recipe or cannot be printed)."""
        for text in value if isinstance(value, list) else (value,):
            if isinstance(text, str) and ("\x00" in text or _has_surrogate(text)):
                raise ValueError("text must not contain a NUL byte or a lone surrogate (\\x00, \\udXXX)")
        return value


# Linux's PATH_MAX and NAME_MAX: a longer model id, data source or output dir fails in the first
# os.stat with ENAMETOOLONG (an OSError far from the recipe), so it is refused here by name.
MAX_PATH_BYTES, MAX_NAME_BYTES = 4096, 255


def _path_text(value: Any) -> Any:
    """A path or hub id the filesystem can look up: at most 4096 bytes, 255 per `/` part."""
    if isinstance(value, str):
        raw = value.encode("utf-8", "surrogatepass")
        if len(raw) > MAX_PATH_BYTES or any(len(part) > MAX_NAME_BYTES for part in raw.split(b"/")):
            raise ValueError(f"too long for a path or id ({len(raw)} bytes): at most {MAX_PATH_BYTES} bytes, "
                             f"{MAX_NAME_BYTES} per /-separated name")
    return value


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


class ModelSpec(Strict):
    """Where the float model comes from; see `quantlab.models.sources` for the forms of `id`."""

    id: str = Field(min_length=1)
    revision: str | None = None
    gguf_file: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    trust_remote_code: bool = False
    allow_pickle: bool = Field(default=False, description=(
        "read a checkpoint stored only as pickle (.bin / .pt, through torch.load(weights_only=True)); "
        "off: safetensors (or GGUF) only, since unpickling can run code"))

    @field_validator("id", "revision", "gguf_file")
    @classmethod
    def _paths(cls, value: Any) -> Any:
        return _path_text(value)


class DatasetSpec(Strict):
    """A text source: a shortcut name, a `datasets` hub id, `modelscope:` id or a local file."""

    source: str = Field(min_length=1)
    subset: str | None = None
    split: str = "train"
    text_field: str = "text"
    format: Literal["text", "chat"] = "text"
    max_documents: int | None = Field(default=None, gt=0, le=10**9)

    @field_validator("source")
    @classmethod
    def _paths(cls, value: Any) -> Any:
        return _path_text(value)


class CalibrationSpec(Strict):
    dataset: DatasetSpec
    num_samples: int = Field(default=128, gt=0, le=100_000)
    seq_len: int = Field(default=512, ge=16, le=131_072)
    strategy: Literal["random_windows", "concat_chunk", "per_document"] = "random_windows"
    all_experts: bool = Field(default=False, description=(
        "mixture-of-experts models: every expert's statistics (GPTQ Hessian, AWQ Gram, ranges) see every "
        "calibration token, not only those routed to it; routing and layer outputs are unchanged, so no "
        "expert is left without calibration (costs one expert forward per token and expert)"))
    offload: Literal["none", "cpu"] = Field(default="none", description=(
        "where the calibration activations (every sample's input and output of the current layer) live "
        "between uses: none = on the compute device; cpu = in pinned host memory, copied to the GPU one "
        "batch at a time (less GPU memory, some copy time); placement only: results are identical"))


# torch.manual_seed (the run's seed, `quantlab.pipeline`) takes 0 <= seed < 2**64; numpy's
# default_rng and random.Random (ROUGE subsets, bootstrap) take any non-negative integer.
MAX_SEED = 2**64 - 1
SEED_HELP = "0 <= seed <= 2**64 - 1 (torch.manual_seed's range)"
# Larger than any Linear's input dimension; the model-dependent `group_size <= in_features`
# is checked where the model is known.
MAX_GROUP_SIZE = 2**16


def _scheme_from_preset(value: Any) -> Any:
    if isinstance(value, str):
        if value not in PRESETS:
            raise ValueError(f"unknown preset {_short(value)}; presets: {', '.join(PRESETS)}")
        return PRESETS[value]
    if isinstance(value, dict) and isinstance(value.get("bits"), float):
        # Literal[2, 3, 4, 8] matches 4.0 == 4 even in strict mode
        raise ValueError(f"bits: got {_short(value['bits'])}, an integer is needed: 2, 3, 4 or 8")
    return value


def _bounded_scheme(value: Any) -> Any:
    group = getattr(value, "group_size", None)
    if group is not None and group > MAX_GROUP_SIZE:
        raise ValueError(f"group_size: got {_short(group)}; must be null (per-channel) or a power of two "
                         f"from 8 to {MAX_GROUP_SIZE} (2**16)")
    return value


class WeightStage(Strict):
    """Fields every weight-quantizing stage shares: the scheme (or a preset name) and ignores."""

    weights: WeightScheme = Field(default_factory=lambda: PRESETS["W4A16"])
    ignore: list[str] = Field(default_factory=list, description="fnmatch patterns of Linear names")

    @field_validator("weights", mode="before")
    @classmethod
    def _preset(cls, value: Any) -> Any:
        return _scheme_from_preset(value)

    @field_validator("weights")
    @classmethod
    def _bounded(cls, value: Any) -> Any:
        return _bounded_scheme(value)


class HeadOption(Strict):
    """For stages that can also quantize the output projection."""

    lm_head: bool = Field(default=False, description=(
        "also quantize lm_head with this scheme, on the last layer's outputs (tied input "
        "embeddings are untied and stay float); cuts decode reads by the head's share"))


class RtnStage(HeadOption, WeightStage):
    """Round-to-nearest: the baseline every other algorithm must beat."""


class GptqStage(HeadOption, WeightStage):
    """GPTQ: Hessian-guided column-by-column rounding with error compensation (needs calibration)."""

    damp_percent: float = Field(default=0.01, gt=0, le=1, description="fraction of mean diag(H) added to diag(H)")
    block_size: int = Field(default=128, ge=1, le=8192, description="columns per lazy-update block")
    act_order: bool = Field(default=False, description="quantize columns by descending diag(H) (desc_act)")
    static_groups: bool = Field(default=False, description="group qparams from the original weights; g_idx = i // G")
    true_sequential: bool = Field(default=True, description="quantize q,k,v → o → gate,up → down, re-observing inputs")
    # On by default: on SmolLM2 W4 g64 it cuts perplexity 29.69 → 28.61 (benchmarks/results/peers_cpu.md)
    # for about 40 s of single-threaded search on 2 CPU cores; min/max ranges waste resolution on outliers.
    mse_clip: bool = Field(default=True, description="each group's range by a shrink search minimising |q(w) − w|^2.4")


class AwqStage(WeightStage):
    """AWQ: activation-aware input-channel scales folded into the preceding op, then per-group
    clipping. Encodes with RTN; a following rtn/gptq stage re-encodes the rescaled weights."""

    grid: int = Field(default=20, ge=1, le=1000, description="scale exponents α = i/grid, i < grid")
    duo_scaling: bool = Field(default=True, description="s = x̄^α / w̄^(1−α) instead of x̄^α")
    clip: bool = Field(default=True, description="search a per-group clipping range after scaling")
    clip_grid: int = Field(default=20, ge=1, le=1000, description="shrink ratios from 1 to 1 − max_shrink")
    max_shrink: float = Field(default=0.5, gt=0, lt=1)
    clip_skip: list[str] = Field(default_factory=lambda: ["self_attn.q_proj", "self_attn.k_proj"],
                                 description="fnmatch patterns of layer-relative Linear names left unclipped")
    max_tokens: int = Field(default=8192, gt=0, le=10**8,
                            description="calibration tokens observed per layer")
    # Measured at W4 g128 asym (block vs linear): Gemma-3-270m 26.25 vs 26.66 (float 21.96, 4 × 512
    # windows), SmolLM2 41.16 vs 41.16 (float 33.56, 10 windows); ~4× the search time on CPU.
    objective: Literal["linear", "block"] = Field(default="linear", description=(
        "what the scales of a norm-fed group (q/k/v, gate/up) minimize: linear = the error of the group's "
        "Linear outputs (from the input Gram, fast); block = the decoder layer's output error with those "
        "Linears fake-quantized (AutoAWQ's attention / MLP output objective; sees q·k, norms, biases)"))
    block_tokens: int = Field(default=2048, gt=0, le=10**8,
                              description="tokens per layer the block objective forwards")


class SmoothQuantStage(Strict):
    """SmoothQuant: migrate activation outliers into the weights with per-input-channel scales
    `s = max|X|^α / max|W|^(1−α)` folded into the preceding norm / Linear. Changes float
    weights only (no codes): put it before the weight and act_ranges stages."""

    alpha: float = Field(default=0.5, ge=0, le=1, description="migration strength when not searched")
    search: bool = Field(default=False, description="pick α per layer and group by W8A8 output error")
    grid: int = Field(default=10, ge=1, le=1000, description="searched α = i/grid, i = 0..grid (plus no smoothing)")
    weights: WeightScheme | None = Field(
        default=None, description="weight scheme the search fake-quantizes with; null = the next weight stage's")
    activations: ActivationScheme | None = Field(
        default=None, description="activation scheme the search fake-quantizes with; null = the act_ranges stage's")
    max_tokens: int = Field(default=1024, gt=0, le=10**8,
                            description="calibration tokens per layer used by the search")
    skip: list[str] = Field(default_factory=list,
                            description="fnmatch patterns of producers (layer-relative: mlp.up_proj) not to smooth")

    @field_validator("weights", mode="before")
    @classmethod
    def _preset(cls, value: Any) -> Any:
        return _scheme_from_preset(value)

    @field_validator("weights")
    @classmethod
    def _bounded(cls, value: Any) -> Any:
        return _bounded_scheme(value)


class ActRangesStage(Strict):
    """Calibrate activation and KV-cache ranges (A8W8 / FP8 / C8) on the layer as quantized so
    far; stores absmax tables in the canonical form for evaluation and export."""

    activations: ActivationScheme | None = Field(default_factory=ActivationScheme,
                                                 description="null = keep Linear inputs in float")
    kv_cache: KVCacheScheme | None = Field(default=None, description="null = float KV cache")
    ignore: list[str] = Field(default_factory=list, description="fnmatch patterns of Linears whose inputs stay float")

    @model_validator(mode="after")
    def _something(self) -> "ActRangesStage":
        if self.activations is None and self.kv_cache is None:
            raise ValueError("act_ranges needs activations or kv_cache (or both)")
        return self


class StageEntry(Strict):
    """One stage, written as a single-key mapping: `- rtn: {...}`."""

    rtn: RtnStage | None = None
    gptq: GptqStage | None = None
    awq: AwqStage | None = None
    smoothquant: SmoothQuantStage | None = None
    act_ranges: ActRangesStage | None = None

    @model_validator(mode="before")
    @classmethod
    def _exactly_one(cls, data: Any) -> Any:
        if not isinstance(data, dict) or len(data) != 1:
            kinds = ", ".join(cls.model_fields)
            raise ValueError(f"each stage is a mapping with exactly one key, one of: {kinds}")
        (key, value), = data.items()
        return {key: {} if value is None else value}

    @property
    def kind(self) -> str:
        return next(k for k in type(self).model_fields if getattr(self, k) is not None)

    @property
    def config(self) -> BaseModel:
        return getattr(self, self.kind)

    def dump(self) -> dict[str, Any]:
        """`{kind: params}` as a recipe writes it. Nulls are kept: `group_size: null` means
        per-channel, and dropping it would read back as the default 128."""
        return {self.kind: self.config.model_dump(mode="json")}


class PerplexitySpec(Strict):
    dataset: DatasetSpec
    seq_len: int = Field(default=2048, ge=16, le=131_072)
    max_windows: int | None = Field(default=None, gt=0, le=10**7)
    baseline: bool = True
    kl_divergence: bool = Field(default=True, description=(
        "with the baseline, also KL(float ‖ quantized) per token and top-1 agreement on the same windows"))


class SummaryDataSpec(Strict):
    """Documents with reference summaries: a shortcut (`cnn_dailymail`, `lcsts`), a `datasets`
    hub id, or a local `.jsonl` / `.json` / `.parquet` file."""

    source: str = Field(min_length=1)
    subset: str | None = None
    split: str | None = Field(default=None, description="null = the shortcut's evaluation split, else validation")
    document_field: str | None = Field(default=None, description="null = the shortcut's, or the first of "
                                       "article, document, text, content, source present")
    reference_field: str | None = Field(default=None, description="null = the shortcut's, or the first of "
                                        "highlights, summary, reference, target, abstract present")

    @field_validator("source")
    @classmethod
    def _paths(cls, value: Any) -> Any:
        return _path_text(value)


class RougeSpec(Strict):
    """Summaries generated greedily by the float and the quantized model on the same prompts,
    scored with ROUGE against the references (`quantlab.eval.rouge`, `quantlab.eval.summaries`)."""

    dataset: SummaryDataSpec
    num_samples: int = Field(default=100, gt=0, le=100_000)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED, description="null = the first num_samples "
                             "records; a number = a random subset drawn with it")
    max_input_tokens: int = Field(default=512, ge=16, le=131_072, description="the document is cut to this "
                                  "many tokens; the instruction around it is kept whole")
    max_new_tokens: int = Field(default=100, ge=1, le=4096, description="as TensorRT-LLM's summarize example")
    batch_size: int = Field(default=16, ge=1, le=1024)
    prompt: Literal["auto", "chat", "plain"] = Field(default="auto", description="auto = the chat template "
                                                     "when the tokenizer has one (instruct models), else plain")
    template: str | None = Field(default=None, description="the prompt text around {document}; null = "
                                 "'Summarize this article in a few sentences.\\n\\n{document}' as the user "
                                 "turn of a chat, '{document}\\nTL;DR:' as plain text")
    tokenize: Literal["auto", "words", "chars"] = Field(default="auto", description="words: rouge-score's "
                                                        "tokenizer with stemming; chars: one token per CJK/Thai "
                                                        "character; auto: by the references' script")
    baseline: bool = Field(default=True, description="also generate with the float model and report the difference")
    bootstrap: int = Field(default=1000, ge=100, le=100_000, description="paired bootstrap resamples of the difference")

    @field_validator("template")
    @classmethod
    def _one_document(cls, v: str | None) -> str | None:
        if v is not None and v.count("{document}") != 1:
            raise ValueError("must contain {document} exactly once")
        return v


class EvaluateSpec(Strict):
    perplexity: PerplexitySpec | None = None
    rouge: RougeSpec | None = None


class VerifySpec(Strict):
    """Runner vs fake-quant model (`quantlab.runner.verify`): per-layer and logit errors and
    greedy agreement on prompts, and both perplexities on the same windows."""

    prompts: list[str] = Field(default_factory=list, description="text prompts; empty = num_prompts from the dataset")
    num_prompts: int = Field(default=16, gt=0, le=1024, description="prompts cut from the dataset when prompts is empty")
    prompt_tokens: int = Field(default=32, ge=1, le=8192, description="tokens per prompt cut from the dataset")
    max_new_tokens: int = Field(default=64, ge=1, le=4096, description="greedy tokens generated per prompt")
    dataset: DatasetSpec | None = Field(default=None, description="null = evaluate.perplexity's, else calibration's")
    perplexity_windows: int = Field(default=4, ge=0, le=100_000, description="windows scored by both models; 0 = skip")
    seq_len: int = Field(default=512, ge=16, le=131_072, description="perplexity window length")
    precision: Literal["model", "float64"] = Field(
        default="model", description="model: both sides in model.dtype on the run's device; float64: both in "
        "float64 on the CPU, so per-token int8 / FP8 activation codes no longer flip on last-bit rounding "
        "differences and a disagreement means the two compute different things")


class OutputSpec(Strict):
    # min_length: an empty dir would silently mean the default, runs/<name>; null says that
    dir: str | None = Field(default=None, min_length=1, description="run directory; null = runs/<name>")

    @field_validator("dir")
    @classmethod
    def _paths(cls, value: Any) -> Any:
        return _path_text(value)


class Recipe(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=128)
    seed: int = Field(ge=0, le=MAX_SEED, description=SEED_HELP)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    model: ModelSpec
    calibration: CalibrationSpec | None = None
    stages: list[StageEntry] = Field(min_length=1)
    evaluate: EvaluateSpec = Field(default_factory=EvaluateSpec)
    export: list[ExportFormat] = Field(default_factory=list, description="formats written to <run dir>/export/")
    verify: VerifySpec | None = Field(default=None, description="check the runner against the fake-quant model")
    output: OutputSpec = Field(default_factory=OutputSpec)

    @model_validator(mode="after")
    def _activation_stages(self) -> "Recipe":
        check_activation_stages(self)
        return self

    @model_validator(mode="after")
    def _verify_data(self) -> "Recipe":
        v = self.verify
        if v is not None and verify_dataset(self) is None:
            if v.perplexity_windows:
                raise ValueError("verify.perplexity_windows: needs a dataset (verify.dataset, evaluate.perplexity"
                                 ".dataset or calibration.dataset); or set perplexity_windows: 0")
            if not v.prompts:
                raise ValueError("verify.prompts: give prompts or a dataset to cut them from (verify.dataset, "
                                 "evaluate.perplexity.dataset or calibration.dataset)")
        return self

    @model_validator(mode="after")
    def _head_exports(self) -> "Recipe":
        heads = [f"stages[{i}].{e.kind}.lm_head" for i, e in enumerate(self.stages)
                 if getattr(e.config, "lm_head", False)]
        refused = [f for f in self.export if f not in HEAD_FORMATS]
        if heads and refused:
            raise ValueError(f"{heads[0]}: export {refused[0]} keeps lm_head in float and cannot carry its codes; "
                             f"export as {', '.join(HEAD_FORMATS)} or set lm_head: false")
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.output.dir if self.output.dir else f"runs/{self.name}")

    @property
    def offload_activations(self) -> bool:
        """Whether the calibration activations live on the CPU between uses (`calibration.offload`)."""
        return self.calibration is not None and self.calibration.offload == "cpu"


WEIGHT_KINDS = ("rtn", "gptq", "awq")


def verify_dataset(recipe: Recipe) -> DatasetSpec | None:
    """The text the verify stage cuts prompts and perplexity windows from."""
    if recipe.verify is not None and recipe.verify.dataset is not None:
        return recipe.verify.dataset
    if recipe.evaluate.perplexity is not None:
        return recipe.evaluate.perplexity.dataset
    return recipe.calibration.dataset if recipe.calibration is not None else None


def check_activation_stages(recipe: Recipe) -> None:
    """Cross-stage rules for smoothquant / act_ranges / FP8 weights; fills the search's
    activation scheme from the act_ranges stage (per-token dynamic int8 without one) and its
    weight scheme from the next weight stage (W8A16 without one)."""
    kinds = [e.kind for e in recipe.stages]
    for i, entry in enumerate(recipe.stages):
        w = getattr(entry.config, "weights", None)
        if entry.kind in ("gptq", "awq") and w is not None and (w.type == "float" or w.per_tensor):
            raise ValueError(f"stages[{i}].{entry.kind}.weights: FP8 and per-tensor weights are encoded by "
                             "rtn only; use `- rtn: {weights: FP8}`")
        if entry.kind in ("smoothquant", "act_ranges", "gptq", "awq") and recipe.calibration is None:
            raise ValueError(f"stages[{i}].{entry.kind}: needs calibration data (add a calibration section)")
        if entry.kind == "smoothquant" and any(k in WEIGHT_KINDS + ("act_ranges",) for k in kinds[:i]):
            raise ValueError(f"stages[{i}].smoothquant: must come before every weight and act_ranges stage "
                             "(it rescales the float weights those stages encode)")
    ranges = next((e.act_ranges for e in recipe.stages if e.act_ranges is not None), None)
    for i, entry in enumerate(recipe.stages):
        if entry.smoothquant is not None and entry.smoothquant.activations is None:
            acts = ranges.activations if ranges is not None and ranges.activations is not None else None
            entry.smoothquant.activations = acts or ActivationScheme()
        if entry.smoothquant is not None and entry.smoothquant.weights is None:
            after = next((e.config.weights for e in recipe.stages[i + 1:] if e.kind in WEIGHT_KINDS), None)
            entry.smoothquant.weights = after or PRESETS["W8A16"]


# --------------------------------------------------------------------------- bounded YAML

# Limits of the one YAML reader used for recipe files and `--set` values. A recipe is a few
# KB (the shipped ones are under 2 KB) and a handful of levels deep; these bounds leave two
# orders of magnitude of room while keeping hostile input (deep nesting, alias bombs, huge
# files) to milliseconds and one line instead of a RecursionError, a hang or a memory blow-up.
MAX_YAML_BYTES = 1 << 20  # 1 MiB, checked before parsing (a long string or comment reads in 0.2 s)
MAX_YAML_NODES = 20_000  # scalars and collections; pure-Python PyYAML reads ~50k nodes/s, so a
# 1 MiB flow list of 500k numbers would take 10 s: stop it after 20k (a recipe has ~100)
MAX_YAML_DEPTH = 64  # nested collections; PyYAML's composer recurses ~3 frames per level
MAX_ALIAS_NODES = 10_000  # nodes reachable through aliases, counted as if expanded


class YamlLimitError(yaml.YAMLError):
    """Input refused by `BoundedLoader`: `line` (1-based, or None) and a one-line `text`."""

    def __init__(self, text: str, mark: Any = None):
        super().__init__(text)
        self.text = text
        self.line = mark.line + 1 if mark is not None else None


class BoundedLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` (standard tags only) that refuses duplicate mapping keys and bounds
    nesting depth and alias expansion while composing, before anything recurses or expands."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0
        self._alias_nodes = 0
        self._sizes: dict[int, int] = {}  # id(node) -> node count with aliases expanded

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            node = super().compose_node(parent, index)
            self._alias_nodes += self._sizes.get(id(node), 1)
            if self._alias_nodes > MAX_ALIAS_NODES:
                raise YamlLimitError(f"aliases expand to more than {MAX_ALIAS_NODES} nodes "
                                     "(an alias bomb?); write the values out", event.start_mark)
            return node
        self._depth += 1
        self._nodes += 1
        if self._depth > MAX_YAML_DEPTH:
            raise YamlLimitError(f"nested more than {MAX_YAML_DEPTH} levels deep", event.start_mark)
        if self._nodes > MAX_YAML_NODES:
            raise YamlLimitError(f"more than {MAX_YAML_NODES} values; a recipe has about a hundred",
                                 event.start_mark)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if isinstance(node, yaml.SequenceNode):
            self._sizes[id(node)] = 1 + sum(self._sizes.get(id(c), 1) for c in node.value)
        elif isinstance(node, yaml.MappingNode):
            self._sizes[id(node)] = 1 + sum(self._sizes.get(id(k), 1) + self._sizes.get(id(v), 1)
                                            for k, v in node.value)
        return node

    def construct_object(self, node: Any, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, OverflowError) as exc:  # a 5000-digit int, 2001-02-30, ...
            why = "integer with too many digits" if "digits" in str(exc) else _clean(str(exc))[:80]
            raise YamlLimitError(f"cannot read value ({why})", node.start_mark) from None

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *base` keys may be overridden, as YAML says
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                    seen.add(key)
                except TypeError:
                    continue  # unhashable: the base constructor says so with its own mark
                if duplicate:
                    raise YamlLimitError(f"duplicate key {_short(key)}", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str) -> Any:
    """Parse one YAML document with `BoundedLoader`; raises `yaml.YAMLError` (`YamlLimitError`
    for the bounds above), never RecursionError."""
    if len(text) > MAX_YAML_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_YAML_BYTES:
        raise YamlLimitError(f"larger than {MAX_YAML_BYTES // (1 << 20)} MiB; a recipe is a few KB")
    loader = BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


# --------------------------------------------------------------------------- loading


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read, override and validate a recipe; raises `UserError` with a one-line message."""
    path = Path(path)
    raw = read_yaml(path)
    for item in overrides or []:
        apply_override(raw, item)
    return validate_recipe(raw, origin=str(path))


def read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise UserError(f"{path}: recipe file not found")
    try:
        with path.open("rb") as f:
            data = f.read(MAX_YAML_BYTES + 1)  # never more, whatever the file's size
        if len(data) > MAX_YAML_BYTES:
            raise YamlLimitError(f"larger than {MAX_YAML_BYTES // (1 << 20)} MiB; a recipe is a few KB")
        raw = parse_yaml(data.decode("utf-8"))
    except YamlLimitError as exc:
        where = f"line {exc.line}: " if exc.line else ""
        raise UserError(f"{path}: {where}{exc.text}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = _clean(getattr(exc, "problem", None) or "invalid YAML")
        raise UserError(f"{path}: not valid YAML{where}: {problem}") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a UTF-8 text file") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: a recipe is a YAML mapping with keys name, seed, model, stages, ...")
    return raw


# Segments of a `--set` path: ASCII letters, digits, `_` and `-` (no empty segment; a list
# index is ASCII digits only: `str.isdigit` also takes '²').
OVERRIDE_KEY = re.compile(r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*", re.ASCII)


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply `a.b.0.c=value` (value parsed as YAML) to the raw recipe mapping."""
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise UserError(f"--set {_short(item)}: expected key.path=value, e.g. calibration.num_samples=64")
    if not OVERRIDE_KEY.fullmatch(key):
        raise UserError(f"--set {_short(key)}: a key path is ASCII names and list indexes joined by dots, "
                        "e.g. stages.0.rtn.weights.group_size")
    try:
        value = parse_yaml(text)
    except YamlLimitError as exc:
        raise UserError(f"--set {key}=...: {exc.text}") from None
    except yaml.YAMLError:
        value = text
    parts = key.split(".")
    node: Any = raw
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not part.isdecimal() or len(part) > 9 or int(part) >= len(node):
                raise UserError(f"--set {key}: {part!r} is not an index of a {len(node)}-item list")
            part = int(part)
        elif not isinstance(node, dict):
            # e.g. `stages.0.rtn.weights.bits=8` over `weights: W8A16`: silently replacing the
            # preset by {bits: 8} would drop its other fields, so refuse and say what to set.
            raise UserError(f"--set {key}: {'.'.join(parts[:i])} is a value ({_short(node)}), not a "
                            f"mapping; set it whole with --set {'.'.join(parts[:i])}=...")
        if last:
            node[part] = value
        else:
            if isinstance(node, dict) and node.get(part) is None:
                node[part] = {}  # absent or null: create the mapping the path goes through
            node = node[part]


def validate_recipe(raw: dict[str, Any], origin: str = "recipe") -> Recipe:
    try:
        # strict: "64", 64.0 and true are not integers, "true" and 1 not booleans (floats take ints)
        return Recipe.model_validate(raw, strict=True)
    except ValidationError as exc:
        raise UserError(f"{origin}: {describe_validation_error(exc)}") from None


def yaml_path(loc: tuple[Any, ...]) -> str:
    """`('stages', 0, 'rtn', 'bits')` → `stages[0].rtn.bits`."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            text = _clean(str(part))
            out += ("." if out else "") + (text if len(text) <= 64 else text[:61] + "...")
    return out or "(top level)"


def describe_validation_error(exc: ValidationError) -> str:
    errors = exc.errors(include_url=False)
    first = errors[0]
    loc = tuple(p for p in first["loc"] if not _is_union_tag(p))
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        allowed = _allowed_keys(loc[:-1])
        msg = f"unknown key; allowed here: {', '.join(allowed)}" if allowed else "unknown key"
    elif first["type"] == "missing":
        msg = "required field is missing"
    elif not loc and first["type"] == "value_error":
        return msg  # a cross-field rule (Recipe validators) names its own paths
    else:
        msg = f"got {_short(first.get('input'))}: {_clean(msg)}"
        if loc and loc[-1] == "seed" and first["type"] in ("less_than_equal", "greater_than_equal"):
            msg = f"got {_short(first.get('input'))}: must be {SEED_HELP}"
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return f"{yaml_path(loc)}: {msg}{more}"


def _is_union_tag(part: Any) -> bool:
    return isinstance(part, str) and (part.startswith("function-") or part in {"str", "int"})


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 50, 50
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 4


def _short(value: Any) -> str:
    """A bounded, printable summary of a user's value: never the repr of a whole (possibly
    alias-shared or huge) structure, nor `str()` of a 5000-digit int (Python refuses it)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of {len(str(value)) if value.bit_length() < 10_000 else 'thousands of'} digits"
    text = _clean(_REPR.repr(value))
    return text if len(text) <= 60 else text[:57] + "..."


def _clean(text: str) -> str:
    """Control characters and lone surrogates escaped: the message stays one printable line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _allowed_keys(loc: tuple[Any, ...]) -> list[str]:
    """Walk the schema along `loc` to list the keys valid at that place."""
    model: Any = Recipe
    for part in loc:
        if isinstance(part, int):
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = _model_of(field.annotation)
    return list(getattr(model, "model_fields", {}))


def _model_of(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def dump_recipe(recipe: Recipe) -> str:
    """The resolved recipe as YAML that `load_recipe` accepts again (one key per stage)."""
    raw = recipe.model_dump(mode="json")
    raw["stages"] = [entry.dump() for entry in recipe.stages]
    return yaml.safe_dump(raw, sort_keys=False)

