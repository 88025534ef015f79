"""GGUF (llama.cpp) file for llama and qwen2, written with the `gguf` package.

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
when the recipe lists the K-quant) are written as F16 and handed to llama.cpp's own quantizer (llama-cpp-python, in its tool
environment), so the file carries llama.cpp's K-quant mix of the weights quantlab computed.
Float 2-D tensors (embedding, head, Linears the recipe left in float) are F16 in an f16 file
and Q8_0 otherwise; 1-D tensors (norms, biases) are F32. llama-arch Q and K rows are
permuted for llama.cpp's rotary layout (`convert_hf_to_gguf.py` `LlamaModel.permute`);
qwen2 is not. The tokenizer comes from the canonical `tokenizer.json` the way llama.cpp's
converter writes a GPT-2 BPE vocab (tokens, token types, merges, special ids, chat template).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from quantlab.errors import UserError
from quantlab.export.checks import Report
from quantlab.export.source import Canonical, head_dim, linear_shapes, read_sidecar, sidecar_source, write_sidecar
from quantlab.formats import K_QUANTS  # through llama.cpp's quantizer
from quantlab.models.arch import ARCH_SPECS
from quantlab.quant.primitives import QuantizedWeight
from quantlab.quant.scheme import WeightScheme

NAME = "gguf"
BLOCK = 32
ARCHS = {"llama": True, "qwen2": False}  # model_type → permute Q/K
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
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def tensor_map(config: dict[str, Any]) -> Any:
    import gguf

    arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}[config["model_type"]]
    return gguf.get_tensor_name_map(arch, int(config["num_hidden_layers"]))


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
                  extra={"file": fname, "permuted_qk": ARCHS[src.model_type]})


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
    permute = ARCHS[src.model_type]
    config, tmap = src.config, tensor_map(src.config)
    writer = gguf.GGUFWriter(file, src.model_type)
    add_hparams(writer, config, file_type, str(src.quant_config.get("source_model") or config.get("_name_or_path")
                                                 or src.model_type))
    add_tokenizer(writer, src.path, int(config["vocab_size"]))
    modules: dict[str, Any] = {}
    names = sorted({*src.tensors, *(f"{n}.weight" for n in src.quantized)}, key=_tensor_order)
    for hf_name in names:
        module = hf_name.rsplit(".", 1)[0]
        heads = qk_heads(hf_name, config) if permute else None
        qw = src.quantized.get(module) if hf_name.endswith(".weight") else None
        data, gtype, how = _encode_tensor(src, hf_name, None if folded else qw, qtype, heads)
        writer.add_tensor(gguf_name(tmap, hf_name), data, raw_dtype=gtype)
        if qw is not None:
            modules[module] = {"tensor": gguf_name(tmap, hf_name), "type": gtype.name, "encoding": how}
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return modules


def _tensor_order(name: str) -> tuple:
    parts = name.split(".")
    layer = int(parts[2]) if len(parts) > 2 and parts[1] == "layers" else -1
    return (layer if layer >= 0 else (1e9 if not name.startswith("model.embed") else -1), name)


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
    module = hf_name.rsplit(".", 1)[0]
    folded = hf_name.endswith(".weight") and module in src.quantized
    t = (src.folded[module] if folded else src.tensors[hf_name]).float()
    if heads is not None:
        t = t[permute_rows(t.shape[0], heads)]
    data, gtype = encode_float(t.numpy(), qtype)
    return data, gtype, gtype.name


# ----------------------------------------------------------------------------- reader


def gguf_path(path: Path) -> Path:
    files = sorted(path.glob("*.gguf")) if path.is_dir() else [path]
    if len(files) != 1:
        raise UserError(f"{path}: expected exactly one .gguf file, found {len(files)}")
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
    """Dequantized float tensors under their Hugging Face names (Q/K un-permuted), and metadata."""
    import gguf

    reader = reader or gguf.GGUFReader(gguf_path(path))
    meta = metadata(reader)
    arch = meta["general.architecture"]
    config = {"model_type": arch, "num_hidden_layers": meta[f"{arch}.block_count"],
              "num_attention_heads": meta[f"{arch}.attention.head_count"],
              "num_key_value_heads": meta[f"{arch}.attention.head_count_kv"]}
    reverse = _reverse_names(config, meta)
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        hf = reverse.get(t.name)
        if hf is None:
            raise UserError(f"{path}: tensor {t.name} has no Hugging Face name for {arch}")
        w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        heads = qk_heads(hf, config) if ARCHS.get(arch) else None
        if heads is not None:
            inverse = torch.argsort(permute_rows(w.shape[0], heads))
            w = w[inverse]
        out[hf] = w
    return out, meta


def _reverse_names(config: dict[str, Any], meta: dict[str, Any]) -> dict[str, str]:
    spec = ARCH_SPECS[config["model_type"]]
    tmap = tensor_map(config)
    hf = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(int(config["num_hidden_layers"])):
        pre = f"{spec.layers}.{i}"
        hf += [f"{pre}.input_layernorm.weight", f"{pre}.post_attention_layernorm.weight"]
        hf += [f"{pre}.{lin}.{s}" for lin in spec.linears for s in ("weight", "bias")]
    return {gguf_name(tmap, n): n for n in hf}


# ----------------------------------------------------------------------------- validator

REQUIRED_KEYS = ("context_length", "embedding_length", "block_count", "feed_forward_length",
                 "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
                 "rope.freq_base", "rope.dimension_count")


def validate(path: Path, source: Canonical | None = None) -> Report:
    """`source`: the canonical form, when the caller already has it loaded."""
    import gguf

    report = Report(NAME, str(path))
    reader = gguf.GGUFReader(gguf_path(path))
    meta = metadata(reader)
    arch = meta.get("general.architecture")
    if not report.check("config value", "general.architecture", arch in ARCHS,
                        f"expected one of {', '.join(ARCHS)}, got {arch!r}"):
        return report
    for key in ("general.file_type", "general.quantization_version", *(f"{arch}.{k}" for k in REQUIRED_KEYS),
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
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in reader.fields else None
    if not report.ok:
        return report
    n_layer, hidden = int(meta[f"{arch}.block_count"]), int(meta[f"{arch}.embedding_length"])
    config = {"model_type": arch, "num_hidden_layers": n_layer, "hidden_size": hidden,
              "intermediate_size": int(meta[f"{arch}.feed_forward_length"]),
              "num_attention_heads": int(meta[f"{arch}.attention.head_count"]),
              "num_key_value_heads": int(meta[f"{arch}.attention.head_count_kv"]),
              "head_dim": int(meta.get(f"{arch}.attention.key_length") or meta[f"{arch}.rope.dimension_count"])}
    report.check("token count", "tokenizer.ggml.token_type",
                 len(reader.fields["tokenizer.ggml.token_type"].data) == n_vocab, "differs from tokenizer.ggml.tokens")
    tensors = {t.name: t for t in reader.tensors}
    tmap, spec = tensor_map(config), ARCH_SPECS[arch]
    F32 = gguf.GGMLQuantizationType.F32
    expected: dict[str, tuple[int, ...]] = {"token_embd.weight": (n_vocab, hidden), "output_norm.weight": (hidden,)}
    if "output.weight" in tensors:
        expected["output.weight"] = (n_vocab, hidden)
    for i in range(n_layer):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            expected[gguf_name(tmap, f"{spec.layers}.{i}.{norm}.weight")] = (hidden,)
        for lin, (out_f, in_f) in linear_shapes(config, spec).items():
            expected[gguf_name(tmap, f"{spec.layers}.{i}.{lin}.weight")] = (out_f, in_f)
            if spec.qkv_bias and lin in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                expected[gguf_name(tmap, f"{spec.layers}.{i}.{lin}.bias")] = (out_f,)
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
    report.facts.update({"architecture": arch, "file_type": meta.get("general.file_type"), "layers": n_layer,
                         "types": sorted({t.tensor_type.name for t in reader.tensors}), "tokens": n_vocab,
                         "tokenizer.pre": meta.get("tokenizer.ggml.pre")})
    side = read_sidecar(path) if path.is_dir() else None
    if side:
        encodings = Counter(m["encoding"] for m in side.get("modules", {}).values())
        report.facts["quantized Linears"] = ", ".join(f"{n} {e}" for e, n in sorted(encodings.items()))
    if report.ok:
        check_against_source(report, path, reader, source)
    return report


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
