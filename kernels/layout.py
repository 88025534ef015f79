"""Packed weight layouts for the GEMM kernels, and repacking from quantlab's canonical form.

Canonical form (quantlab.quant.primitives.QuantizedWeight): codes uint8 `[N, K]` (N = out,
K = in), scales f32 `[N, groups]`, zeros uint8 `[N, groups]`, g_idx int32 `[K]`.

**WNA16 layout (W4A16, W8A16)** — built so the tensor cores take the weights straight from
the loaded words, with no shuffle of the dequantized values:

* `qweight` is int32 `[Kp·bits/32, N]` (N contiguous; K padded to a multiple of 128 with code
  0 — the kernels zero the activations past K, so the pad contributes nothing). Columns are
  independent, so Linears that share an input can be fused by concatenating along N.
* Within a column, K is permuted in blocks of 8 words (BK = 8·P codes, P = 32/bits codes per
  word: 64 for int4, 32 for int8): word j, slot s = (P/2)·h + d (bits s·bits…) holds
  k = 16·d + 2·j + h of the block (`kernel_k_order`). Then `(w >> d·bits) & 0x000F000F` puts
  the codes of k = 16d + 2j and 16d + 2j + 1 in the two 16-bit halves of one register, and
  OR-ing the exponent of 128 (bf16) or 1024 (fp16) turns them into the exact half-precision
  pair `128 + q` that the MMA's A-operand fragment wants for row n, k pair (2j, 2j+1) of a
  K = 16 slice d: one LOP3 (+ one shift) per two codes, the zero point one packed
  subtract. The K = 16 slice d reads the contiguous activations `x[16d : 16d + 16]`.
  Kernels that take whole blocks in another order (the M = 1 GEMV reads the codes slot by
  slot and gathers the activations in that stored order; the int8 tensor-core path permutes
  its joined float operand back to k order) need no second format.
* `scales` and `zeros` are `[groups, N]` floats in the activation dtype by default (integer
  zero points are exact in bf16/fp16); dequant is `w = (q − z)·s`. The MMA runs on the exact
  `q − z` and the scale multiplies each group's partial product once per output.
* Any group size that is a multiple of P (every WeightScheme group size) is supported; groups
  that are multiples of BK take the fast path, smaller ones scale each weight before the MMA.
  Group tails (K not a multiple of G) follow `g = k // G`.
* Act-order (GPTQ `desc_act`): when `g_idx` is not `i // G` but sorting the columns by group
  gives `i // G`, the columns are stored in that sorted order and `perm` is kept; the forward
  pass gathers `x[..., perm]` first (one extra read of the activations, which is cheap next to
  the weights at decode sizes). Any other g_idx is rejected.

**W8A8 int8**: `w` int8 `[N, K]` (K contiguous, the layout wgmma needs for 8-bit operands),
`scale` f32 `[N]`; an asymmetric per-channel zero point becomes `zc = z − 128` `[N]` (int32),
applied in the epilogue as `acc − zc·rowsum(x_q)`.

**FP8 e4m3**: `w` float8_e4m3fn `[N, K]`, `scale` f32 `[N]` (per-row) or `[1]` (per-tensor).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantlab.quant.packing import pack, unpack
from quantlab.quant.primitives import QuantizedWeight, default_g_idx

BLOCK_K = 128


@dataclass
class PackedWNA16:
    """Weight-only int4/int8 weights in the MMA-ordered layout (see module docstring)."""

    qweight: torch.Tensor  # int32 [Kp * bits / 32, N], K permuted per block (kernel_k_order)
    scales: torch.Tensor  # [groups, N]
    zeros: torch.Tensor  # [groups, N], integer zero points stored as floats
    bits: int
    group_size: int | None  # None = per-channel
    in_features: int  # K (unpadded)
    out_features: int  # N
    perm: torch.Tensor | None = None  # act-order column gather applied to x, int64 [K]

    @property
    def words_per_block(self) -> int:
        """Word rows per 128-wide K block."""
        return 4 * self.bits

    @property
    def kernel_ok(self) -> bool:
        """Whether the Triton kernels support this group size (else the reference runs)."""
        return self.group_size is None or self.group_size % (32 // self.bits) == 0

    @property
    def gemv_ok(self) -> bool:
        """Whether the M = 1 GEMV takes this layout: per-channel scales or groups of whole
        blocks (64 k for int4, 32 for int8)."""
        return self.group_size is None or self.group_size % (256 // self.bits) == 0

    @property
    def group_constexpr(self) -> int:
        """Group size as the kernels see it: 0 = one group (per-channel)."""
        return 0 if self.group_size is None else self.group_size

    def to(self, device: torch.device | str) -> "PackedWNA16":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return PackedWNA16(move(self.qweight), move(self.scales), move(self.zeros), self.bits,
                           self.group_size, self.in_features, self.out_features, move(self.perm))


@dataclass
class PackedW8A8:
    w: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # f32 [N]
    zc: torch.Tensor | None = None  # int32 [N], zero - 128 (None when symmetric)

    def to(self, device) -> "PackedW8A8":
        return PackedW8A8(self.w.to(device), self.scale.to(device),
                          None if self.zc is None else self.zc.to(device))


@dataclass
class PackedFP8:
    w: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # f32 [N] (per-row) or [1] (per-tensor)

    @property
    def per_row(self) -> bool:
        return self.scale.numel() > 1 or self.w.shape[0] == 1

    def to(self, device) -> "PackedFP8":
        return PackedFP8(self.w.to(device), self.scale.to(device))


# ---------------------------------------------------------------------------------------------
# WNA16


def _group_size_of(qw: QuantizedWeight) -> int | None:
    if qw.scales.shape[1] == 1:
        return None
    return qw.scheme.group_size


def act_order_perm(g_idx: torch.Tensor, group_size: int | None) -> torch.Tensor | None:
    """Column permutation that makes `g_idx` equal `i // G`, None if it already is.

    Raises when no permutation does (group sizes other than G apart from the tail)."""
    k = g_idx.numel()
    want = default_g_idx(k, group_size).to(g_idx.device)
    if torch.equal(g_idx.to(torch.int32), want):
        return None
    perm = torch.argsort(g_idx.to(torch.int64), stable=True)
    if not torch.equal(g_idx[perm].to(torch.int32), want):
        raise ValueError("g_idx is neither i // G nor a permutation of it; cannot repack")
    return perm


def pack_kn(codes_kn: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes `[K, N]` → int32 `[K·bits/32, N]`, sequential along K (quantlab.quant.packing)."""
    return pack(codes_kn.t(), bits).t().contiguous()


def unpack_kn(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_kn`: int32 `[K·bits/32, N]` → uint8 codes `[K, N]`."""
    return unpack(qweight.t(), bits, qweight.shape[0] * (32 // bits)).t()


def kernel_k_order(kp: int, bits: int) -> torch.Tensor:
    """Source k of each stored code position along a column (see the module docstring):
    stored position `BK·b + P·j + (P/2)·h + d` holds k = `BK·b + 16·d + 2·j + h`."""
    per = 32 // bits
    bk = 8 * per
    j, h, d = torch.meshgrid(torch.arange(8), torch.arange(2), torch.arange(per // 2), indexing="ij")
    within = (16 * d + 2 * j + h).reshape(-1)
    return (torch.arange(kp // bk)[:, None] * bk + within[None, :]).reshape(-1)


def pack_wna16(qw: QuantizedWeight, dtype: torch.dtype = torch.bfloat16,
               scale_dtype: torch.dtype | None = None) -> PackedWNA16:
    """Repack canonical int4/int8 weights for the WNA16 kernels.

    `scale_dtype` defaults to the activation dtype (halves the scale traffic next to f32);
    pass torch.float32 to keep the canonical scales exactly."""
    bits = qw.scheme.bits
    if qw.scheme.type != "int" or bits not in (4, 8):
        raise ValueError(f"WNA16 kernels take 4- or 8-bit integer weights, got {qw.scheme.name}")
    n, k = qw.codes.shape
    g = _group_size_of(qw)
    perm = act_order_perm(qw.g_idx, g)
    codes = qw.codes if perm is None else qw.codes[:, perm]
    kp = -(-k // BLOCK_K) * BLOCK_K
    codes_kn = torch.zeros(kp, n, dtype=torch.uint8, device=codes.device)
    codes_kn[:k] = codes.t()
    codes_kn = codes_kn[kernel_k_order(kp, bits).to(codes.device)]
    sd = scale_dtype or dtype
    scales = qw.scales.float().t().contiguous().to(sd)  # [groups, N]
    zeros = qw.zeros.float().t().contiguous().to(sd)
    return PackedWNA16(pack_kn(codes_kn, bits), scales, zeros, bits, g, k, n, perm)


def dequantize_wna16(p: PackedWNA16) -> torch.Tensor:
    """Float32 weight `[N, K]` in the ORIGINAL column order (what the layer computes)."""
    stored = unpack_kn(p.qweight, p.bits)  # [Kp, N], kernel order
    codes = torch.empty_like(stored)
    codes[kernel_k_order(stored.shape[0], p.bits).to(stored.device)] = stored
    codes = codes[: p.in_features].float()  # [K, N]
    g = p.group_size or p.in_features
    gi = torch.arange(p.in_features, device=codes.device) // g
    w = (codes - p.zeros.float()[gi]) * p.scales.float()[gi]  # [K, N], stored (permuted) order
    w = w.t()
    if p.perm is not None:
        out = torch.empty_like(w)
        out[:, p.perm] = w
        w = out
    return w.contiguous()


# ---------------------------------------------------------------------------------------------
# W8A8 and FP8


def pack_w8a8(qw: QuantizedWeight) -> PackedW8A8:
    """Canonical 8-bit integer weights (per-channel or per-tensor) → int8 + per-row scale.

    Codes are stored as `q − 128` (exact in int8); a zero point other than 128 (asymmetric)
    is kept as `zc = z − 128` for the epilogue correction."""
    if qw.scheme.type != "int" or qw.scheme.bits != 8 or qw.scales.shape[1] != 1:
        raise ValueError(f"W8A8 needs 8-bit per-channel integer weights, got {qw.scheme.name}")
    w = (qw.codes.to(torch.int16) - 128).to(torch.int8).contiguous()
    zc = qw.zeros[:, 0].to(torch.int32) - 128
    return PackedW8A8(w, qw.scales[:, 0].float().contiguous(), None if not zc.any() else zc)


def pack_fp8(qw: QuantizedWeight) -> PackedFP8:
    """Canonical FP8 weights (codes float8_e4m3fn, zeros 0) → kernel form."""
    if qw.scheme.type != "float":
        raise ValueError(f"pack_fp8 takes FP8 schemes, got {qw.scheme.name}")
    scale = qw.scales[:, 0].float()
    if qw.scheme.per_tensor:
        scale = scale[:1]
    return PackedFP8(qw.codes.contiguous(), scale.contiguous())


def quantize_fp8_weight(w: torch.Tensor, per_row: bool = True) -> PackedFP8:
    """Float weight `[N, K]` → FP8 e4m3 with `s = absmax / 448` per row or per tensor."""
    from quantlab.quant.activations import quantize_fp8_weight as q

    codes, scale = q(w, per_channel=per_row)
    return PackedFP8(codes.contiguous(), scale.reshape(-1).float().contiguous())


def quantize_int8_weight(w: torch.Tensor) -> PackedW8A8:
    """Float weight `[N, K]` → symmetric per-channel int8 on [−127, 127]."""
    from quantlab.quant.activations import quantize_int8_weight as q

    codes, scale = q(w)
    return PackedW8A8(codes.contiguous(), scale.reshape(-1).float().contiguous())
