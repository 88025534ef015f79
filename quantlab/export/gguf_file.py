"""GGUF (llama.cpp) file for llama, qwen2, qwen3, mixtral, qwen2_moe and qwen3_moe, written with
the `gguf` package.

GGUF has its own block formats, so the canonical weights (AWQ scales and clipping already
folded in) are re-encoded per 32-column block:
  * transcoded, exact up to fp16 scale rounding, when the canonical codes fit the block type
    and every 32-column block lies inside one canonical group: Q8_0 stores `q − z` as int8 with
    `d = s`; Q4_0 stores `q − z + 8` with `d = s`; Q4_1 stores `q` with `d = s, m = −z·s`;
  * a scheme a block type cannot hold (act-order groups, asymmetric 8-bit codes in Q8_0, more
    than 4 bits or, for Q4_0, asymmetric codes in a 4-bit block) is refused
    (`check_exportable`): it would be rounded a second time. F16 is always the dequantized
    weight in fp16.
K-quants (Q4_K_M, Q5_K_M, Q6_K) have no exact transcoding: the folded canonical weights (kept
when the recipe lists the K-quant) are written as F16 and handed to llama.cpp's own quantizer
(llama-cpp-python, in its tool environment), so the file carries llama.cpp's K-quant mix of the
weights quantlab computed.
Float 2-D tensors (embedding, head, Linears the recipe left in float) are F16 in an f16 file
and Q8_0 otherwise; 1-D tensors (norms, biases, qwen3's per-head q/k norms) and MoE routers are
F32 (llama.cpp's converter keeps routers in F32 too: a rounded router logit can pick another
expert). llama-arch Q and K rows are permuted for llama.cpp's rotary layout
(`convert_hf_to_gguf.py` `LlamaModel.permute`); qwen2/qwen3 (NeoX rotary) are not. The
tokenizer comes from the canonical `tokenizer.json` the way llama.cpp's converter writes a GPT-2
BPE vocab (tokens, token types, merges, special ids, chat template).

Mixture-of-experts: llama.cpp keeps a layer's experts in one stacked tensor per projection
(`ffn_gate_exps` / `ffn_up_exps` `[E, inter, hidden]`, `ffn_down_exps` `[E, hidden, inter]`),
which the converter builds by stacking `mlp.experts.E.*_proj` into `mlp.experts.*_proj`
before its name map; here each expert is encoded on its own (transcoded blocks, F16, or
float) and the block rows are stacked, so the codes stay exact. The router is `ffn_gate_inp`,
Qwen2-MoE's shared expert `ffn_{gate,up,down}_shexp` with its gate `ffn_gate_inp_shexp` (1-D,
as llama.cpp declares it and its quantizer rewrites it).
Mixtral is llama.cpp's `llama` arch with experts (Q/K permuted); `read` tells it from llama by
its expert count and gives every expert back under its own name. llama.cpp hard-codes per
arch whether the top-k routing weights are renormalized (llama/mixtral and qwen3moe: yes,
qwen2moe: no) and ignores sliding windows in these archs, so a config that says otherwise
(`norm_topk_prob`, an active `sliding_window`) is refused rather than exported to compute
something else. llama.cpp's qwen2moe loads no tied head: a tied Qwen2-MoE gets its embedding
again as `output.weight`.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from quantlab.errors import UserError
from quantlab.file_checks import check_gguf
from quantlab.export.checks import Report
from quantlab.export.source import (Canonical, head_dim, linear_shapes, read_sidecar, router_width, sidecar_source,
                                   write_sidecar)
from quantlab.formats import K_QUANTS  # through llama.cpp's quantizer
from quantlab.models.arch import MOE_ARCH_SPECS, ArchSpec, n_experts, spec_for_config
from quantlab.quant.primitives import QuantizedWeight
from quantlab.quant.scheme import WeightScheme

NAME = "gguf"
BLOCK = 32
# model_type → (llama.cpp arch, Q/K rows permuted for its rotary layout)
ARCHS = {"llama": ("llama", True), "qwen2": ("qwen2", False), "qwen3": ("qwen3", False),
         "mixtral": ("llama", True), "qwen2_moe": ("qwen2moe", False), "qwen3_moe": ("qwen3moe", False)}
# whether llama.cpp's MoE graph renormalizes the top-k routing weights (`build_moe_ffn`'s norm_w, hard-coded per arch)
RENORMALIZES = {"mixtral": True, "qwen2_moe": False, "qwen3_moe": True}
NEEDS_OUTPUT = ("qwen2moe",)  # archs whose loader requires `output.weight` (no tied head)
EXPERT_TENSOR = re.compile(r"^(?P<owner>.+\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)\.weight$")
PRE_TOKENIZERS = ("gpt-2", "qwen2", "llama-bpe")  # llama.cpp names (llama-vocab.cpp) tokenizer_pre returns
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


# how far a K-quant may decode from the canonical weight (relative Frobenius error): a wrong
# name, permutation or shape decodes ~100 % off; llama.cpp's own rounding stays well inside
K_QUANT_TOLERANCE = {"q4_k_m": 0.15, "q5_k_m": 0.08, "q6_k": 0.04}


def _types() -> dict[str, tuple[Any, Any]]:
    import gguf

    Q, F = gguf.GGMLQuantizationType, gguf.LlamaFileType
    return {"f16": (Q.F16, F.MOSTLY_F16), "q8_0": (Q.Q8_0, F.MOSTLY_Q8_0),
            "q4_0": (Q.Q4_0, F.MOSTLY_Q4_0), "q4_1": (Q.Q4_1, F.MOSTLY_Q4_1)}


# ----------------------------------------------------------------------------- rotary permutation


def permute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row order llama.cpp wants for a Q/K weight with `n_head` heads: out[i] = w[perm[i]]."""
    idx = torch.arange(n_rows)
    return idx.reshape(n_head, 2, n_rows // n_head // 2).transpose(1, 2).reshape(-1)


def qk_heads(hf_name: str, config: dict[str, Any]) -> int | None:
    if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        return int(config["num_attention_heads"])
    if hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        return int(config.get("num_key_value_heads") or config["num_attention_heads"])
    return None


# ----------------------------------------------------------------------------- block encoding


def _blocks_in_one_group(qw: QuantizedWeight) -> bool:
    in_f = qw.codes.shape[1]
    return in_f % BLOCK == 0 and bool((qw.g_idx.view(-1, BLOCK) == qw.g_idx.view(-1, BLOCK)[:, :1]).all())


def transcode(qw: QuantizedWeight, qtype_name: str) -> np.ndarray | None:
    """Raw GGUF blocks `[out, in/32 · type_size]` carrying the canonical codes, or None when the
    codes do not fit `qtype_name` exactly."""
    if qtype_name == "f16" or not _blocks_in_one_group(qw):
        return None
    out_f, in_f = qw.codes.shape
    idx = qw.g_idx.long().view(-1, BLOCK)[:, 0]  # group of each block
    s = qw.scales[:, idx].to(torch.float16)  # [out, n_blocks]
    z = qw.zeros.to(torch.int16)[:, idx]
    q = qw.codes.to(torch.int16).view(out_f, -1, BLOCK)
    d = s.numpy().view(np.uint8).reshape(out_f, -1, 2)
    if qtype_name == "q8_0":
        v = q - z.unsqueeze(-1)
        if v.min() < -128 or v.max() > 127:
            return None
        payload = v.to(torch.int8).numpy().view(np.uint8)
        return np.concatenate([d, payload], axis=-1).reshape(out_f, -1)
    if qtype_name == "q4_0":
        nib = q - z.unsqueeze(-1) + 8
        if nib.min() < 0 or nib.max() > 15:
            return None
        return np.concatenate([d, _nibbles(nib)], axis=-1).reshape(out_f, -1)
    if qtype_name == "q4_1":
        if q.max() > 15:
            return None
        m = (-(z.float() * qw.scales[:, idx].float())).to(torch.float16).numpy().view(np.uint8).reshape(out_f, -1, 2)
        return np.concatenate([d, m, _nibbles(q)], axis=-1).reshape(out_f, -1)
    raise ValueError(qtype_name)


def _nibbles(v: torch.Tensor) -> np.ndarray:
    """ggml 4-bit block: byte j = value j (low nibble) | value j+16 (high nibble)."""
    v = v.to(torch.uint8)
    return (v[..., :16] | (v[..., 16:] << 4)).numpy()


def encode_float(weight: np.ndarray, qtype_name: str) -> tuple[np.ndarray, Any]:
    """A tensor the run left float (embedding, head, ignored Linears, norms) in a `qtype_name`
    file, as llama.cpp's converter writes it: 1-D as F32, 2-D as F16 in an F16 file and Q8_0
    otherwise (8 bits in a 4-bit file too); returns (data, ggml type)."""
    import gguf

    Q = gguf.GGMLQuantizationType
    if weight.ndim == 1:
        return weight.astype(np.float32), Q.F32
    if qtype_name == "f16" or weight.shape[-1] % BLOCK:
        return weight.astype(np.float16), Q.F16
    return gguf.quants.quantize(weight.astype(np.float32), Q.Q8_0), Q.Q8_0


# ----------------------------------------------------------------------------- writer


def _rope_theta(config: dict[str, Any]) -> float:
    rope = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    kind = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise UserError(f"{NAME}: rope type {kind!r} is not exported yet (only default rotary)")
    return float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0)


def tokenizer_pre(tok: dict[str, Any]) -> str:
    """llama.cpp's pre-tokenizer name for the tokenizer.json pre-tokenizer."""
    pre = tok.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"  # llama.cpp's spelling; "gpt2" is refused at load ("unknown pre-tokenizer type")
    if pre.get("type") == "Sequence":
        for p in pre.get("pretokenizers", []):
            regex = (p.get("pattern") or {}).get("Regex") if p.get("type") == "Split" else None
            if regex == QWEN2_REGEX:
                return "qwen2"
            if regex == LLAMA3_REGEX:
                return "llama-bpe"
    raise UserError(f"{NAME}: tokenizer pre-tokenizer {json.dumps(pre)[:120]} has no known llama.cpp name "
                    "(known: GPT-2 byte-level, qwen2, llama-bpe)")


def add_tokenizer(writer: Any, src_dir: Path, vocab_size: int) -> None:
    import gguf

    path = src_dir / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"{NAME}: {src_dir} has no tokenizer.json (GGUF embeds the tokenizer)")
    tok = json.loads(path.read_text(encoding="utf-8"))
    if (tok.get("model") or {}).get("type") != "BPE":
        raise UserError(f"{NAME}: only byte-level BPE tokenizers are exported; got {tok['model'].get('type')!r}")
    vocab: dict[int, str] = {i: t for t, i in tok["model"]["vocab"].items()}
    added = {a["id"]: a for a in tok.get("added_tokens", [])}
    vocab.update({i: a["content"] for i, a in added.items()})
    if max(vocab) >= vocab_size:
        raise UserError(f"{NAME}: tokenizer id {max(vocab)} >= model vocab_size {vocab_size}")
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in vocab:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(vocab[i])
            types.append(gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(vocab[i])
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tokenizer_pre(tok))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(src_dir, load_merges=True, n_vocab=vocab_size).add_to_gguf(writer, quiet=True)


def add_hparams(writer: Any, config: dict[str, Any], file_type: Any, name: str) -> None:
    import gguf

    hd = head_dim(config)
    writer.add_name(name)
    writer.add_context_length(int(config["max_position_embeddings"]))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(int(config["num_attention_heads"]))
    writer.add_head_count_kv(int(config.get("num_key_value_heads") or config["num_attention_heads"]))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_rope_dimension_count(hd)
    if hd != int(config["hidden_size"]) // int(config["num_attention_heads"]):
        writer.add_key_length(hd)
        writer.add_value_length(hd)
    writer.add_vocab_size(int(config["vocab_size"]))
    if n_experts(config):
        add_moe_hparams(writer, config)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def add_moe_hparams(writer: Any, config: dict[str, Any]) -> None:
    """The keys llama.cpp's converter writes for these families: Qwen-MoE experts are
    `moe_intermediate_size` wide (llama.cpp would otherwise take `feed_forward_length / top-k`),
    Mixtral's are `intermediate_size` (`feed_forward_length`)."""
    writer.add_expert_count(n_experts(config))
    writer.add_expert_used_count(int(config["num_experts_per_tok"]))
    if config.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
    if config.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(int(config["shared_expert_intermediate_size"]))


def tensor_map(config: dict[str, Any]) -> Any:
    import gguf

    name = ARCHS[config["model_type"]][0]
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == name)
    return gguf.get_tensor_name_map(arch, int(config["num_hidden_layers"]))


def stacked_name(hf_name: str) -> tuple[str, int] | None:
    """`….experts.E.gate_proj.weight` → (`….experts.gate_proj.weight`, E): the tensor llama.cpp
    stacks a layer's experts into (its converter's merged name), and the expert's index."""
    m = EXPERT_TENSOR.match(hf_name)
    return (f"{m['owner']}.{m['proj']}.weight", int(m["e"])) if m else None


def tensor_shapes(config: dict[str, Any], spec: ArchSpec) -> dict[str, tuple[int, ...]]:
    """Logical `[out, in]` shape of every tensor a file of `config` may hold, by Hugging Face
    name; a layer's experts under their stacked name, `[E, out, in]`; lm_head (optional)."""
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
                                          "lm_head.weight": (vocab, hidden)}
    for i in range(int(config["num_hidden_layers"])):
        pre = f"{spec.layers}.{i}"
        shapes.update({f"{pre}.{n}.weight": (hidden,) for n in spec.norms})
        shapes.update({f"{pre}.{n}.weight": (head_dim(config),) for n in spec.head_norms})
        shapes.update({f"{pre}.{n}.weight": (router_width(config, n), hidden) for n in spec.float_linears})
        for lin, shape in linear_shapes(config, spec).items():
            stacked = stacked_name(f"{pre}.{lin}.weight")
            if stacked:
                shapes[stacked[0]] = (n_experts(config), *shape)
            else:
                shapes[f"{pre}.{lin}.weight"] = shape
            if spec.qkv_bias and lin in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                shapes[f"{pre}.{lin}.bias"] = (shape[0],)
    return shapes


def gguf_name(tmap: Any, hf_name: str) -> str:
    name = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise UserError(f"{NAME}: no GGUF tensor name for {hf_name}")
    return name


CARRIES = {"q8_0": "int codes of ≤7 bits, or symmetric 8-bit ones", "q4_0": "symmetric int codes of ≤4 bits",
           "q4_1": "int codes of ≤4 bits"}


def carries_codes(scheme: WeightScheme, act_order: bool, qtype: str) -> bool:
    """Whether a block type holds a scheme's codes exactly (`transcode`): groups that are whole
    32-column blocks (no act-order), and codes whose `q − z` fits the block (Q8_0: int8, Q4_0:
    the nibble around 8) or whose `q` does (Q4_1, with its own minimum)."""
    blocks_fit = not act_order and (scheme.group_size is None or scheme.group_size % BLOCK == 0)
    if scheme.type != "int" or not blocks_fit:
        return False
    if qtype == "q8_0":
        return scheme.bits <= 7 or scheme.symmetric
    return scheme.bits <= 4 and (qtype == "q4_1" or scheme.symmetric)


def check_exportable(src: Canonical, qtype: str = "q8_0") -> None:
    """Refuse what would round the run's codes a second time: a block type that cannot hold them
    (`carries_codes`), a K-quant without the float weights before rounding. F16 carries any
    scheme (the dequantized weight in fp16)."""
    if src.model_type not in ARCHS:
        raise UserError(f"{NAME}: model_type {src.model_type!r} is not exported; supported: {', '.join(ARCHS)}")
    check_llama_cpp_computes_it(src.config)
    choices = (*_types(), *K_QUANTS)
    if qtype not in choices:
        raise UserError(f"{NAME}: tensor type {qtype!r}; choose one of {', '.join(choices)}")
    if qtype in K_QUANTS and src.quantized and not _has_folded(src):
        raise UserError(f"gguf-{qtype}: llama.cpp's quantizer reads the float weights before rounding, which this "
                        f"run did not keep; list gguf-{qtype} in the recipe's export and rerun it (calibration is "
                        "reused), or export a GGUF type that carries the codes (gguf-q8_0, gguf-q4_0, gguf-q4_1)")
    if qtype in CARRIES:
        for scheme in {qw.scheme for qw in src.quantized.values()}:
            if not carries_codes(scheme, src.act_order, qtype):
                others = [f"gguf-{q}" for q in CARRIES if q != qtype and carries_codes(scheme, src.act_order, q)]
                raise UserError(f"gguf-{qtype}: {qtype.upper()} holds {CARRIES[qtype]} in whole 32-column groups; "
                                f"{scheme.name}{' with act-order' if src.act_order else ''} would be rounded a "
                                f"second time (export {' or '.join([*others, 'gguf-f16'])}, or quantize with "
                                "codes and groups it holds)")


def check_llama_cpp_computes_it(config: dict[str, Any]) -> None:
    """Refuse a config llama.cpp would run differently from transformers: it hard-codes whether
    an arch renormalizes the top-k routing weights (`RENORMALIZES`), and these archs have no
    sliding-window attention."""
    model_type = config["model_type"]
    if model_type in RENORMALIZES:
        norm = bool(config.get("norm_topk_prob", True))  # Mixtral always renormalizes
        if norm != RENORMALIZES[model_type]:
            raise UserError(f"{NAME}: {model_type} with norm_topk_prob={norm}: llama.cpp's "
                            f"{ARCHS[model_type][0]} {'always' if RENORMALIZES[model_type] else 'never'} "
                            "renormalizes the top-k routing weights, so it would compute another model")
    window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
    if window and int(window) < int(config["max_position_embeddings"]):
        raise UserError(f"{NAME}: {model_type} with sliding_window={config['sliding_window']}: llama.cpp's "
                        f"{ARCHS[model_type][0]} attends to the whole context, so it would compute another model")


def write(src: Canonical, tmp: Path, final: Path, qtype: str = "q8_0") -> None:
    check_exportable(src, qtype)
    tmp.mkdir(parents=True)
    fname = f"model-{qtype.upper()}.gguf"
    if qtype in K_QUANTS:
        from quantlab.toolenv import llama_quantize

        f16 = tmp / "model-F16.partial.gguf"
        modules = _write_file(src, f16, "f16", folded=True)
        llama_quantize(f16, tmp / fname, qtype)
        f16.unlink()
        how = "llama.cpp quantizer of the folded float weights"
        modules = {m: {**info, "type": qtype.upper(), "encoding": how} for m, info in modules.items()}
    else:
        modules = _write_file(src, tmp / fname, qtype)
    write_sidecar(src, final, tmp, f"gguf-{qtype}", {"type": qtype}, modules=modules,
                  extra={"file": fname, "permuted_qk": ARCHS[src.model_type][1]})


def _has_folded(src: Canonical) -> bool:
    """The run kept the float weights before rounding (the recipe listed a K-quant): AWQ /
    SmoothQuant folds and clipping carry over into llama.cpp's K-quant, GPTQ's error
    compensation does not. Re-quantizing the codes instead rounds twice: on SmolLM2 an
    AWQ+GPTQ g32 run's Q4_K_M scored 31.31 from the kept weights and 34.36 from the codes,
    against llama.cpp's Q4_K_M of the float model at 30.67 (benchmarks/results/export_engines_cpu.md)."""
    return set(src.quantized) <= set(src.folded)


def _write_file(src: Canonical, file: Path, qtype: str, folded: bool = False) -> dict[str, Any]:
    """One GGUF file of type `qtype`; returns the sidecar's per-Linear record. `folded`: the
    quantized Linears as their float weights before rounding (`src.folded`)."""
    import gguf

    _, file_type = _types()[qtype]
    config, tmap = src.config, tensor_map(src.config)
    writer = gguf.GGUFWriter(file, ARCHS[src.model_type][0])
    add_hparams(writer, config, file_type, str(src.quant_config.get("source_model") or config.get("_name_or_path")
                                                 or src.model_type))
    add_tokenizer(writer, src.path, int(config["vocab_size"]))
    modules: dict[str, Any] = {}
    for hf_name, members in _file_tensors(src):
        name = gguf_name(tmap, hf_name)
        encoded = [_encode_member(src, member, qtype, folded) for member in members]
        data, gtype = _stack(hf_name, members, encoded)
        writer.add_tensor(name, data, raw_dtype=gtype)
        for e, (member, (_, member_type, how)) in enumerate(zip(members, encoded)):
            module = member.rsplit(".", 1)[0]
            if member.endswith(".weight") and module in src.quantized:
                expert = {"expert": e} if stacked_name(member) else {}
                modules[module] = {"tensor": name, **expert, "type": member_type.name, "encoding": how}
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return modules


def _file_tensors(src: Canonical) -> list[tuple[str, list[str]]]:
    """Each tensor of the file as (its Hugging Face name, the canonical tensors it holds): one,
    or a layer's experts in expert order under their stacked name (`stacked_name`)."""
    names = {*src.tensors, *(f"{n}.weight" for n in src.quantized)}
    if src.tied and ARCHS[src.model_type][0] in NEEDS_OUTPUT:
        names.add("lm_head.weight")
    groups: dict[str, dict[int, str]] = {}
    for name in names:
        key, e = stacked_name(name) or (name, 0)
        groups.setdefault(key, {})[e] = name
    out = []
    for key in sorted(groups, key=_tensor_order):
        members = groups[key]
        if sorted(members) != list(range(len(members))):
            raise UserError(f"{NAME}: {key} stacks experts {sorted(members)}; llama.cpp needs every expert")
        out.append((key, [members[e] for e in range(len(members))]))
    return out


def _stack(hf_name: str, members: list[str], encoded: list[tuple[np.ndarray, Any, str]]) -> tuple[np.ndarray, Any]:
    """The file tensor's data and ggml type: one member's, or the experts' block rows stacked
    along a new first dim (gguf keeps the last, byte dim: the logical shape is `[E, out, in]`)."""
    if not stacked_name(members[0]):
        return encoded[0][0], encoded[0][1]
    types = {gtype for _, gtype, _ in encoded}
    if len(types) > 1:
        raise UserError(f"{NAME}: the experts of {hf_name} are {', '.join(sorted(t.name for t in types))}; llama.cpp "
                        "stacks a layer's experts into one tensor of one type (quantize all experts or none)")
    return np.stack([data for data, _, _ in encoded]), types.pop()


def _tensor_order(name: str) -> tuple:
    parts = name.split(".")
    layer = int(parts[2]) if len(parts) > 2 and parts[1] == "layers" else -1
    return (layer if layer >= 0 else (1e9 if not name.startswith("model.embed") else -1), name)


def _encode_member(src: Canonical, hf_name: str, qtype: str, folded: bool) -> tuple[np.ndarray, Any, str]:
    module = hf_name.rsplit(".", 1)[0]
    qw = src.quantized.get(module) if hf_name.endswith(".weight") and not folded else None
    heads = qk_heads(hf_name, src.config) if ARCHS[src.model_type][1] else None
    return _encode_tensor(src, hf_name, qw, qtype, heads)


def _encode_tensor(src: Canonical, hf_name: str, qw: QuantizedWeight | None, qtype: str,
                   heads: int | None) -> tuple[np.ndarray, Any, str]:
    import gguf

    if qw is not None:
        if heads is not None:
            perm = permute_rows(qw.codes.shape[0], heads)
            qw = QuantizedWeight(qw.codes[perm], qw.scales[perm], qw.zeros[perm], qw.g_idx, qw.scheme)
        if qtype == "f16":
            return qw.dequantize().numpy().astype(np.float16), gguf.GGMLQuantizationType.F16, "f16"
        raw = transcode(qw, qtype)
        if raw is None:  # check_exportable refused what the block type cannot hold
            raise AssertionError(f"{hf_name}: {qw.scheme.name} does not transcode to {qtype}")
        return raw, _types()[qtype][0], "transcoded"
    t = _float_tensor(src, hf_name).float()
    if heads is not None:
        t = t[permute_rows(t.shape[0], heads)]
    if _is_router(src.spec, hf_name):
        return t.reshape(file_shape(tuple(t.shape))).numpy(), gguf.GGMLQuantizationType.F32, "F32"
    data, gtype = encode_float(t.numpy(), qtype)
    return data, gtype, gtype.name


def _float_tensor(src: Canonical, hf_name: str) -> torch.Tensor:
    """A tensor kept in float: a quantized Linear's weight before rounding (`src.folded`), the
    embedding for a tied head an arch needs written (`NEEDS_OUTPUT`), or the canonical tensor."""
    module = hf_name.rsplit(".", 1)[0]
    if hf_name.endswith(".weight") and module in src.quantized:
        return src.folded[module]
    if hf_name == "lm_head.weight" and hf_name not in src.tensors:
        return src.tensors["model.embed_tokens.weight"]
    return src.tensors[hf_name]


def _is_router(spec: ArchSpec, hf_name: str) -> bool:
    return hf_name.endswith(tuple(f".{r}.weight" for r in spec.float_linears))


def file_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A one-row matrix is 1-D in the file: llama.cpp declares Qwen2-MoE's shared-expert gate
    `[hidden]` (`ffn_gate_inp_shexp`), and its quantizer rewrites a `[1, hidden]` one so."""
    return shape[1:] if len(shape) == 2 and shape[0] == 1 else shape


# ----------------------------------------------------------------------------- reader


def gguf_path(path: Path) -> Path:
    files = sorted(path.glob("*.gguf")) if path.is_dir() else [path]
    if len(files) != 1:
        raise UserError(f"{path}: expected exactly one .gguf file, found {len(files)}")
    check_gguf(files[0])  # before gguf's reader trusts its declared sizes
    return files[0]


def metadata(reader: Any) -> dict[str, Any]:
    out = {}
    for name, field in reader.fields.items():
        if name.startswith("tokenizer.ggml.") and name not in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
            out[name] = f"<{len(field.data)} entries>" if len(field.data) > 1 else field.contents()
            continue
        try:
            out[name] = field.contents()
        except Exception:  # noqa: BLE001 - an unreadable field is reported, not fatal
            out[name] = "<unreadable>"
    return out


def read(path: Path, reader: Any = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Dequantized float tensors under their Hugging Face names (Q/K un-permuted, stacked experts
    split back into `….experts.E.*_proj.weight`), and metadata."""
    import gguf

    reader = reader or gguf.GGUFReader(gguf_path(path))
    meta = metadata(reader)
    config = config_from_metadata(meta, n_tokens(reader))
    shapes = tensor_shapes(config, spec_for_config(config))
    reverse = {gguf_name(tensor_map(config), n): n for n in shapes}
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        hf = reverse.get(t.name)
        if hf is None:
            raise UserError(f"{path}: tensor {t.name} has no Hugging Face name for {meta['general.architecture']}")
        w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        heads = qk_heads(hf, config) if ARCHS[config["model_type"]][1] else None
        if heads is not None:
            inverse = torch.argsort(permute_rows(w.shape[0], heads))
            w = w[inverse]
        out.update(_unstack(hf, w.reshape(shapes[hf])))  # 1-D one-row matrices back to `[1, in]`
    return out, meta


def n_tokens(reader: Any) -> int:
    field = reader.fields.get("tokenizer.ggml.tokens")
    return len(field.data) if field is not None else 0


def _unstack(hf_name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    if w.ndim != 3:
        return {hf_name: w}
    owner, proj, _ = hf_name.rsplit(".", 2)
    return {f"{owner}.{e}.{proj}.weight": w[e] for e in range(w.shape[0])}


def config_from_metadata(meta: dict[str, Any], vocab_size: int = 0) -> dict[str, Any]:
    """The Hugging Face config fields a file's metadata fixes (model_type, sizes, experts)."""
    arch = meta["general.architecture"]
    key = lambda k: meta.get(f"{arch}.{k}")  # noqa: E731
    experts = int(key("expert_count") or 0)
    types = [t for t, (a, _) in ARCHS.items() if a == arch and (t in MOE_ARCH_SPECS) == bool(experts)]
    if len(types) != 1:
        raise UserError(f"{NAME}: no model_type for llama.cpp arch {arch!r} with {experts} experts")
    model_type = types[0]
    config = {"model_type": model_type, "num_hidden_layers": int(key("block_count")),
              "hidden_size": int(key("embedding_length")), "intermediate_size": int(key("feed_forward_length")),
              "num_attention_heads": int(key("attention.head_count")),
              "num_key_value_heads": int(key("attention.head_count_kv")),
              "head_dim": int(key("attention.key_length") or key("rope.dimension_count")), "vocab_size": vocab_size}
    if experts:
        config.update({MOE_ARCH_SPECS[model_type].experts: experts, "num_experts_per_tok": key("expert_used_count"),
                       "moe_intermediate_size": key("expert_feed_forward_length"),
                       "shared_expert_intermediate_size": key("expert_shared_feed_forward_length")})
    return config


# ----------------------------------------------------------------------------- validator

REQUIRED_KEYS = ("context_length", "embedding_length", "block_count", "feed_forward_length",
                 "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
                 "rope.freq_base", "rope.dimension_count")
MOE_KEYS = ("expert_count", "expert_used_count")
EXPERT_WIDTH_KEYS = {"qwen2moe": ("expert_feed_forward_length", "expert_shared_feed_forward_length"),
                     "qwen3moe": ("expert_feed_forward_length",)}  # without them llama.cpp guesses n_ff / top-k


def required_keys(arch: str, meta: dict[str, Any]) -> tuple[str, ...]:
    moe = arch in EXPERT_WIDTH_KEYS or f"{arch}.expert_count" in meta  # llama with experts: Mixtral
    return (*REQUIRED_KEYS, *(MOE_KEYS if moe else ()), *EXPERT_WIDTH_KEYS.get(arch, ()))


def validate(path: Path, source: Canonical | None = None) -> Report:
    """`source`: the canonical form, when the caller already has it loaded."""
    import gguf

    report = Report(NAME, str(path))
    reader = gguf.GGUFReader(gguf_path(path))
    meta = metadata(reader)
    arch = meta.get("general.architecture")
    archs = sorted({a for a, _ in ARCHS.values()})
    if not report.check("config value", "general.architecture", arch in archs,
                        f"expected one of {', '.join(archs)}, got {arch!r}"):
        return report
    for key in ("general.file_type", "general.quantization_version",
                *(f"{arch}.{k}" for k in required_keys(arch, meta)),
                "tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                "tokenizer.ggml.eos_token_id"):
        report.check("metadata key", key, key in reader.fields, "key is missing")
    report.check("config value", "general.quantization_version", meta.get("general.quantization_version") == 2,
                 f"expected 2, got {meta.get('general.quantization_version')!r}")
    if meta.get("tokenizer.ggml.model") == "gpt2":
        report.check("config value", "tokenizer.ggml.pre", meta.get("tokenizer.ggml.pre") in PRE_TOKENIZERS,
                     f"llama.cpp refuses pre-tokenizer {meta.get('tokenizer.ggml.pre')!r}; "
                     f"names written here: {', '.join(PRE_TOKENIZERS)}")
        report.check("metadata key", "tokenizer.ggml.merges", "tokenizer.ggml.merges" in reader.fields,
                     "a gpt2 (BPE) tokenizer needs merges")
    n_vocab = n_tokens(reader)
    if not report.ok:
        return report
    config = config_from_metadata(meta, n_vocab)
    report.check("token count", "tokenizer.ggml.token_type",
                 len(reader.fields["tokenizer.ggml.token_type"].data) == n_vocab, "differs from tokenizer.ggml.tokens")
    tensors = {t.name: t for t in reader.tensors}
    F32 = gguf.GGMLQuantizationType.F32
    expected = expected_tensors(config, has_output="output.weight" in tensors)
    for name, shape in expected.items():
        t = tensors.get(name)
        if not report.check("present", name, t is not None, "tensor is missing"):
            continue
        logical = tuple(int(x) for x in reversed(t.shape.tolist()))  # GGUF stores ne reversed
        report.check("shape", name, logical == shape, f"expected {list(shape)}, got {list(logical)}")
        if len(shape) == 1:
            report.check("dtype", name, t.tensor_type == F32, f"expected F32, got {t.tensor_type.name}")
    for name in tensors:
        report.check("known tensor", name, name in expected, "not a tensor of this architecture")
    report.facts.update({"architecture": arch, "model_type": config["model_type"],
                         "file_type": meta.get("general.file_type"), "layers": config["num_hidden_layers"],
                         "types": sorted({t.tensor_type.name for t in reader.tensors}), "tokens": n_vocab,
                         "tokenizer.pre": meta.get("tokenizer.ggml.pre")})
    side = read_sidecar(path) if path.is_dir() else None
    if side:
        encodings = Counter(m["encoding"] for m in side.get("modules", {}).values())
        report.facts["quantized Linears"] = ", ".join(f"{n} {e}" for e, n in sorted(encodings.items()))
    if report.ok:
        check_against_source(report, path, reader, source)
    return report


def expected_tensors(config: dict[str, Any], has_output: bool) -> dict[str, tuple[int, ...]]:
    """GGUF name → logical shape of every tensor llama.cpp loads for `config` (`tensor_shapes`);
    `output.weight` where the arch requires it or the file has one."""
    tmap = tensor_map(config)
    shapes = tensor_shapes(config, spec_for_config(config))
    if not has_output and ARCHS[config["model_type"]][0] not in NEEDS_OUTPUT:
        del shapes["lm_head.weight"]
    return {gguf_name(tmap, n): file_shape(shape) for n, shape in shapes.items()}


def check_against_source(report: Report, path: Path, reader: Any, src: Canonical | None) -> None:
    """Decoded weights equal what the writer derives from the canonical form (proves names,
    the Q/K permutation and block packing)."""
    from quantlab.export.source import load_source

    source = sidecar_source(path)
    side = read_sidecar(path)
    if (source is None and src is None) or side is None:
        report.skip("decoded weights", "canonical source not reachable from quantlab_export.json")
        return
    src = src or load_source(source)
    floats, _ = read(path, reader)
    qtype = side["options"]["type"]
    from_folded = qtype in K_QUANTS and _has_folded(src)  # what llama.cpp was given (`write`)
    for module in side["modules"]:
        qw = src.quantized.get(module)
        got = floats.get(f"{module}.weight")
        if not report.check("present", module, qw is not None and got is not None, "missing in source or file"):
            continue
        if qtype in K_QUANTS:
            want = src.folded[module].float() if from_folded else qw.dequantize().float()
            rel = float((got - want).norm() / want.norm().clamp(min=1e-30))
            report.check("decoded weights", module, rel <= K_QUANT_TOLERANCE[qtype],
                         f"{100 * rel:.1f} % from the canonical weight (llama.cpp {qtype} stays within "
                         f"{100 * K_QUANT_TOLERANCE[qtype]:.0f} %)")
            continue
        data, gtype, _ = _encode_tensor(src, f"{module}.weight", qw, qtype, None)
        import gguf

        want = torch.from_numpy(np.array(gguf.quants.dequantize(data, gtype), dtype=np.float32))
        report.check("decoded weights", module, torch.equal(got, want),
                     f"differ from the re-encoded canonical weight (max |diff| {float((got - want).abs().max()):.3g})")


def matches(path: Path) -> bool:
    return (path.is_dir() and len(list(path.glob("*.gguf"))) == 1) or path.suffix == ".gguf"
