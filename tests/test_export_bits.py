"""Bit layouts of the export formats against element-by-element references written from the
formats' own definitions (AutoAWQ `WQLinear_GEMM.from_linear`, GPTQ's 3-bit spill layout,
compressed-tensors `pack_to_int32` when installed)."""

from __future__ import annotations

import pytest
import torch

from quantlab.export.bits import (AWQ_ORDER, pack_awq, pack_dense, pack_int4_pairs, unpack_awq, unpack_dense,
                                  unpack_int4_pairs)
from quantlab.export.gptq import decode_zeros_v1, encode_zeros_v1


def random_codes(shape, bits, seed=0):
    return torch.randint(0, 2**bits, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int64)


def reference_dense(values: torch.Tensor, bits: int) -> list[list[int]]:
    """Bit j·b.. of the run holds value j, words little-endian (rows packed independently)."""
    rows = []
    for row in values.tolist():
        n_words = -(-len(row) * bits // 32)
        big = sum(v << (j * bits) for j, v in enumerate(row))
        rows.append([(big >> (32 * w)) & 0xFFFFFFFF for w in range(n_words)])
    return rows


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("n", [32, 64, 40])
def test_dense_packing_matches_bitstream_reference(bits, n):
    v = random_codes((5, n), bits, seed=bits * n)
    packed = pack_dense(v, bits)
    want = reference_dense(v, bits)
    assert (packed.to(torch.int64) & 0xFFFFFFFF).tolist() == want
    assert torch.equal(unpack_dense(packed, bits, n).to(torch.int64), v)
    # along dim 0 (GPTQ qweight) is the same layout transposed
    assert torch.equal(pack_dense(v.t(), bits, dim=0), packed.t())
    assert torch.equal(unpack_dense(packed.t(), bits, n, dim=0).to(torch.int64), v.t())


def test_gptq_three_bit_spill_layout():
    """GPTQ's 3-bit packing: words 0..2 hold 32 values, value 10 spills bits into word 1 and
    value 21 into word 2 (values 0..9 in word 0 bits 0..29)."""
    v = torch.zeros(1, 32, dtype=torch.int64)
    v[0, 10] = 0b111  # bits 30, 31 of word 0 and bit 0 of word 1
    v[0, 21] = 0b101  # bit 31 of word 1, bits 0..1 of word 2
    words = (pack_dense(v, 3).to(torch.int64) & 0xFFFFFFFF)[0].tolist()
    assert words == [0b11 << 30, (1 << 31) | 0b1, 0b10]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_dense_packing_matches_compressed_tensors(bits):
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    v = random_codes((6, 64), bits, seed=bits)
    signed = (v - 2 ** (bits - 1)).to(torch.int8)
    assert torch.equal(pack_dense(v, bits, dim=1), helpers.pack_to_int32(signed, bits, packed_dim=1))
    assert torch.equal(pack_dense(v, bits, dim=0), helpers.pack_to_int32(signed, bits, packed_dim=0))


def test_awq_interleave_matches_autoawq_loop():
    v = random_codes((3, 24), 4, seed=1)
    want = torch.zeros(3, 3, dtype=torch.int64)
    for col in range(3):  # AutoAWQ: qweight[:, col] |= v[:, col*8 + order[i]] << (i*4)
        for i in range(8):
            want[:, col] |= v[:, col * 8 + AWQ_ORDER[i]] << (i * 4)
    got = pack_awq(v).to(torch.int64) & 0xFFFFFFFF
    assert torch.equal(got, want)
    assert torch.equal(unpack_awq(pack_awq(v)).to(torch.int64), v)
    # interleaved is not sequential: a sequential packer would give different words
    assert not torch.equal(pack_awq(v), pack_dense(v, 4))


def test_int4_pairs_low_nibble_is_even_row():
    signed = torch.tensor([[-8, 7], [3, -1]], dtype=torch.int8)  # rows 0 and 1
    packed = pack_int4_pairs(signed)
    assert packed.shape == (1, 2)
    assert packed.view(torch.uint8).tolist() == [[(3 << 4) | 0x8, (0xF << 4) | 7]]
    full = torch.randint(-8, 8, (10, 6), generator=torch.Generator().manual_seed(2), dtype=torch.int8)
    assert torch.equal(unpack_int4_pairs(pack_int4_pairs(full)), full)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_gptq_v1_zeros_word_wise(bits):
    """v1 stores z − 1; zero points of 0 borrow from the next value, as GPTQModel's writer
    does, and decode back exactly (its loader adds the ones back word-wise)."""
    z = random_codes((4, 64), bits, seed=3)
    z[0, :5] = 0
    words = encode_zeros_v1(z.to(torch.uint8), bits)
    assert torch.equal(decode_zeros_v1(words, bits, 64).to(torch.int64), z)
    nonzero = z.clone()
    nonzero[nonzero == 0] = 1
    # where every zero point is >= 1 the words are exactly the per-value z − 1 packing
    assert torch.equal(encode_zeros_v1(nonzero.to(torch.uint8), bits), pack_dense(nonzero - 1, bits))
    if bits == 4:
        eights = torch.full((1, 8), 8, dtype=torch.uint8)  # symmetric 4-bit: the classic 0x77777777
        assert encode_zeros_v1(eights, 4).item() == 0x77777777
