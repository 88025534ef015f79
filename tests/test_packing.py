"""Bit packing of codes into int32 words: round trips, layout, sign bit, odd lengths."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from quantlab.quant.packing import codes_per_word, pack, unpack

BITS = (2, 3, 4, 8)


@settings(max_examples=25, deadline=None)
@given(bits=st.sampled_from(BITS), rows=st.integers(1, 5), n=st.integers(1, 130), seed=st.integers(0, 2**16))
def test_round_trip_odd_lengths(bits: int, rows: int, n: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (rows, n), generator=gen, dtype=torch.uint8)
    words = pack(codes, bits)
    per = 32 // bits
    assert words.dtype == torch.int32
    assert words.shape == (rows, -(-n // per))
    back = unpack(words, bits, n)
    assert back.dtype == torch.uint8 and torch.equal(back, codes)


@pytest.mark.parametrize("bits", BITS)
def test_layout_is_lowest_bits_first(bits: int) -> None:
    per = 32 // bits
    codes = ((torch.arange(per) * 37 + 5) % 2**bits).to(torch.uint8)  # distinct, high and low
    expected = sum(int(c) << (bits * i) for i, c in enumerate(codes))
    word = int(pack(codes, bits)[0]) & 0xFFFFFFFF
    assert word == expected


@pytest.mark.parametrize("bits", (2, 4, 8))
def test_top_bit_of_the_word_round_trips(bits: int) -> None:
    """A maximal code in the last slot sets bit 31: the word is a negative int32."""
    per = 32 // bits
    qmax = 2**bits - 1
    codes = torch.tensor([[qmax] * per, [0] * (per - 1) + [qmax], [qmax] * (per - 1) + [0]], dtype=torch.uint8)
    words = pack(codes, bits)
    assert words[0, 0] == -1  # all 32 bits set
    assert words[1, 0] < 0 and words[2, 0] >= 0
    assert torch.equal(unpack(words, bits, per), codes)


def test_three_bit_codes_never_straddle_a_word() -> None:
    codes = torch.full((1, 21), 7, dtype=torch.uint8)
    words = pack(codes, 3)
    assert words.shape == (1, 3)
    assert int(words[0, 0]) == 2**30 - 1  # ten codes use bits 0..29, bits 30, 31 stay clear
    assert torch.equal(unpack(words, 3, 21), codes)


def test_leading_dims_and_padding_are_preserved() -> None:
    codes = torch.randint(0, 16, (2, 3, 13), dtype=torch.uint8)
    words = pack(codes, 4)
    assert words.shape == (2, 3, 2)
    assert int(words[..., -1].max()) < 2**20  # padding of the last word is zero
    assert torch.equal(unpack(words, 4, 13), codes)


@pytest.mark.parametrize("bits", (1, 5, 16))
def test_unsupported_bits_are_rejected(bits: int) -> None:
    with pytest.raises(ValueError, match="bits"):
        codes_per_word(bits)


@pytest.mark.parametrize("bits", BITS)
def test_pack_stays_on_the_codes_device(bits: int) -> None:
    """Codes on an accelerator pack there (no CPU-only helper tensors); `meta` stands in for
    any non-CPU device."""
    codes = torch.zeros(3, 37, dtype=torch.uint8, device="meta")
    words = pack(codes, bits)
    assert words.device.type == "meta" and words.shape == (3, -(-37 // (32 // bits)))
    back = unpack(words, bits, 37)
    assert back.device.type == "meta" and back.shape == (3, 37) and back.dtype == torch.uint8
