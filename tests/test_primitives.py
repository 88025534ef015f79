"""Quantize/dequantize primitives: every scheme, odd shapes, group tails, exact grids."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from quantlab.quant.primitives import (
    compute_qparams,
    default_g_idx,
    dequantize,
    fake_quantize_weight,
    num_groups,
    quantize,
    quantize_weight,
)
from quantlab.quant.scheme import PRESETS, WeightScheme

BITS = (2, 3, 4, 8)
GROUPS = (8, 16, 32, 64, 128, None)
FAST = settings(max_examples=25, deadline=None)


def random_weight(out_f: int, in_f: int, seed: int, scale: float = 0.05) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=gen) * scale
    # A few outliers, as real LLM weights have, so groups differ in range.
    w[torch.rand(out_f, in_f, generator=gen) < 0.01] *= 20
    return w


def per_element_qparams(qw) -> tuple[torch.Tensor, torch.Tensor]:
    idx = qw.g_idx.long()
    return qw.scales[:, idx], qw.zeros.float()[:, idx]


schemes = st.builds(WeightScheme, bits=st.sampled_from(BITS), symmetric=st.booleans(),
                    group_size=st.sampled_from(GROUPS))


@FAST
@given(scheme=schemes, out_f=st.integers(1, 13), in_f=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_round_trip_error_bound(scheme: WeightScheme, out_f: int, in_f: int, seed: int) -> None:
    w = random_weight(out_f, in_f, seed)
    qw = quantize_weight(w, scheme)
    groups = num_groups(in_f, scheme.group_size)

    assert qw.codes.dtype == torch.uint8 and qw.codes.shape == (out_f, in_f)
    assert int(qw.codes.max()) <= scheme.qmax
    assert qw.scales.shape == (out_f, groups) and qw.scales.dtype == torch.float32
    assert qw.zeros.shape == (out_f, groups) and qw.zeros.dtype == torch.uint8
    assert int(qw.zeros.max()) <= scheme.qmax
    assert torch.equal(qw.g_idx, default_g_idx(in_f, scheme.group_size))
    assert (qw.scales > 0).all()

    s, z = per_element_qparams(qw)
    position = w / s + z  # where each weight falls on its group's integer grid
    slack = 1e-4  # w / s of a range end lands on ±0.5 up to float rounding
    inside = (position >= -0.5 - slack) & (position <= scheme.qmax + 0.5 + slack)
    # min/max (or absmax) ranges put every weight of its own group inside the grid
    assert inside.all()
    err = (w - qw.dequantize()).abs()
    # float32 rounding of `(q − z)·s` near the range ends costs a few ulps of |w|
    eps = 4 * torch.finfo(torch.float32).eps * (w.abs() + s)
    assert (err[inside] <= (s / 2 + eps)[inside]).all(), float((err / s).max())


@FAST
@given(scheme=schemes, out_f=st.integers(1, 9), in_f=st.integers(1, 200), seed=st.integers(0, 2**16))
def test_values_on_the_grid_reconstruct_exactly(scheme: WeightScheme, out_f: int, in_f: int, seed: int) -> None:
    """With fixed qparams, dequantized codes quantize back to the same codes and values."""
    qw = quantize_weight(random_weight(out_f, in_f, seed), scheme)
    gen = torch.Generator().manual_seed(seed + 1)
    codes = torch.randint(0, scheme.qmax + 1, (out_f, in_f), generator=gen, dtype=torch.uint8)
    on_grid = dequantize(codes, qw.scales, qw.zeros, qw.g_idx)
    again = quantize(on_grid, qw.scales, qw.zeros.float(), qw.g_idx, scheme.bits)
    assert torch.equal(again, codes)
    assert torch.equal(dequantize(again, qw.scales, qw.zeros, qw.g_idx), on_grid)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", (8, 64, None))
def test_asymmetric_grid_weight_is_found_and_reconstructed_exactly(bits: int, group_size: int | None) -> None:
    """A weight that already is an asymmetric grid (power-of-two scale, both ends used) comes
    back bit-exact from quantize_weight: same scale, same zero, zero error."""
    out_f, in_f = 5, 72
    scheme = WeightScheme(bits=bits, symmetric=False, group_size=group_size)
    qmax = scheme.qmax
    groups = num_groups(in_f, group_size)
    gen = torch.Generator().manual_seed(bits)
    scale = 2.0 ** -torch.randint(3, 9, (out_f, groups), generator=gen).float()
    zero = torch.randint(1, qmax, (out_f, groups), generator=gen).float()
    codes = torch.randint(0, qmax + 1, (out_f, in_f), generator=gen, dtype=torch.uint8)
    g_idx = default_g_idx(in_f, group_size)
    for g in range(groups):  # each group spans the whole code range
        cols = (g_idx == g).nonzero().flatten()
        codes[:, cols[0]] = 0
        codes[:, cols[-1]] = qmax
    w = dequantize(codes, scale, zero, g_idx)

    qw = quantize_weight(w, scheme)
    assert torch.equal(qw.scales, scale)
    assert torch.equal(qw.zeros.float(), zero)
    assert torch.equal(qw.codes, codes)
    assert torch.equal(qw.dequantize(), w)


@pytest.mark.parametrize("bits", BITS)
def test_symmetric_zero_point_is_midpoint_and_absmax_sets_scale(bits: int) -> None:
    w = random_weight(4, 40, seed=bits)
    qw = quantize_weight(w, WeightScheme(bits=bits, symmetric=True, group_size=8))
    assert (qw.zeros == 2 ** (bits - 1)).all()
    absmax = w.abs().reshape(4, 5, 8).amax(-1)
    torch.testing.assert_close(qw.scales, absmax / ((2**bits - 1) / 2), rtol=0, atol=0)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("symmetric", (True, False))
def test_zero_stays_exactly_representable(bits: int, symmetric: bool) -> None:
    """Zeros (pruned weights, padding) must dequantize to exactly 0, also in groups that do
    not straddle zero (all-positive rows) and in all-zero groups."""
    w = random_weight(6, 48, seed=1)
    w[0] = w[0].abs() + 0.1  # an all-positive row
    w[1] = -(w[1].abs() + 0.1)  # an all-negative row
    w[2] = 0.0  # an all-zero row
    w[:, ::7] = 0.0
    deq = quantize_weight(w, WeightScheme(bits=bits, symmetric=symmetric, group_size=16)).dequantize()
    assert (deq[w == 0] == 0).all()
    assert torch.isfinite(deq).all()


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("symmetric", (True, False))
@pytest.mark.parametrize("in_f,group_size,last", [(576, 128, 64), (96, 64, 32), (100, 32, 4), (5, 8, 5)])
def test_tail_group_matches_quantizing_the_tail_alone(bits, symmetric, in_f, group_size, last) -> None:
    w = random_weight(7, in_f, seed=in_f)
    qw = quantize_weight(w, WeightScheme(bits=bits, symmetric=symmetric, group_size=group_size))
    groups = -(-in_f // group_size)
    assert qw.scales.shape == (7, groups)
    assert int((qw.g_idx == groups - 1).sum()) == last

    tail = quantize_weight(w[:, -last:], WeightScheme(bits=bits, symmetric=symmetric, group_size=None))
    assert torch.equal(qw.scales[:, -1:], tail.scales)
    assert torch.equal(qw.zeros[:, -1:], tail.zeros)
    assert torch.equal(qw.codes[:, -last:], tail.codes)


@FAST
@given(scheme=schemes, in_f=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_every_group_is_independent(scheme: WeightScheme, in_f: int, seed: int) -> None:
    """Each group's qparams equal those of its columns quantized per-channel on their own."""
    w = random_weight(3, in_f, seed)
    qw = quantize_weight(w, scheme)
    g = in_f if scheme.group_size is None else scheme.group_size
    for group, start in enumerate(range(0, in_f, g)):
        alone = quantize_weight(w[:, start : start + g], scheme.model_copy(update={"group_size": None}))
        assert torch.equal(qw.scales[:, group : group + 1], alone.scales)
        assert torch.equal(qw.zeros[:, group : group + 1], alone.zeros)
        assert torch.equal(qw.codes[:, start : start + g], alone.codes)


def test_smollm2_shape_groups() -> None:
    """SmolLM2 (hidden 576, intermediate 1536) at G=128: 5 groups (last of 64) and 12 groups."""
    assert num_groups(576, 128) == 5 and num_groups(1536, 128) == 12 and num_groups(576, None) == 1
    g_idx = default_g_idx(576, 128)
    assert g_idx.dtype == torch.int32
    assert torch.bincount(g_idx.long()).tolist() == [128, 128, 128, 128, 64]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_fake_quantize_keeps_dtype_and_reduces_distinct_values(name: str) -> None:
    scheme = PRESETS[name]
    w = random_weight(8, 256, seed=3).to(torch.bfloat16)
    fq = fake_quantize_weight(w, scheme)
    assert fq.dtype == torch.bfloat16 and fq.shape == w.shape
    group = 256 if scheme.group_size is None else scheme.group_size
    for row in fq.float():
        for chunk in row.split(group):
            assert chunk.unique().numel() <= 2**scheme.bits


def test_compute_qparams_handles_degenerate_ranges() -> None:
    zeros = torch.zeros(3)
    for symmetric in (True, False):
        scale, zero = compute_qparams(zeros, zeros, 4, symmetric)
        assert (scale > 0).all() and torch.isfinite(scale).all()
        assert ((zero >= 0) & (zero <= 15)).all()


@pytest.mark.parametrize("bad", [0, -64, 100, 4, 96])
def test_scheme_rejects_bad_group_sizes(bad: int) -> None:
    with pytest.raises(ValueError, match="group_size"):
        WeightScheme(group_size=bad)


def test_scheme_names() -> None:
    assert PRESETS["W4A16"].name == "W4A16_g128"
    assert WeightScheme(bits=8, symmetric=False, group_size=None).name == "W8A16_ASYM_c"
