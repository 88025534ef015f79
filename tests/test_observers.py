"""Range observers and the KV observer against direct computations on the same data."""

from __future__ import annotations

import pytest
import torch

from quantlab.engine.observers import BINS, RangeObserver, observe_linears
from quantlab.quant import kv_cache
from conftest import tiny_model


def batches(seed: int = 0, n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # growing spread so the histogram has to widen its range between updates
    return [torch.randn(2, 50, 16, generator=g) * (1 + i) for i in range(n)]


def test_absmax_per_tensor_and_per_channel():
    xs = batches()
    tensor, channel = RangeObserver("absmax"), RangeObserver("absmax", per_channel=True)
    for x in xs:
        tensor.update(x)
        channel.update(x)
    allx = torch.cat([x.reshape(-1, 16) for x in xs])
    assert torch.equal(tensor.result(), allx.abs().max())
    assert torch.equal(channel.result(), allx.abs().amax(dim=0))
    assert channel.count == allx.shape[0]


def test_histogram_keeps_every_sample_when_widening():
    obs = RangeObserver("percentile")
    xs = batches(n=4)
    for x in xs:
        obs.update(x)
    assert obs.hist is not None and obs.hist.shape == (BINS,)
    assert int(obs.hist.sum()) == sum(x.numel() for x in xs)
    assert obs.hist_max == pytest.approx(float(torch.cat([x.flatten() for x in xs]).abs().max()))


@pytest.mark.parametrize("pct", [90.0, 99.0, 99.9])
def test_percentile_matches_quantile(pct: float):
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(1)).reshape(-1, 8)
    obs = RangeObserver("percentile", percentile=pct)
    obs.update(x)
    direct = torch.quantile(x.abs().flatten()[:100_000], pct / 100).item()  # quantile size limit
    width = obs.hist_max / BINS
    assert abs(obs.result().item() - direct) <= 3 * width + 0.01 * direct


def int8_mse(x: torch.Tensor, threshold: float) -> float:
    step = threshold / 127
    q = torch.clamp(torch.round(x / step), -127, 127) * step
    return (q - x).pow(2).mean().item()


def heavy_tailed(seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(40_000, generator=g)
    x[:10] *= 40  # rare outliers: clipping them pays off
    return x.reshape(-1, 10)


def test_mse_threshold_is_near_the_direct_optimum():
    x = heavy_tailed()
    obs = RangeObserver("mse")
    obs.update(x)
    chosen = obs.result().item()
    amax = x.abs().max().item()
    grid = torch.linspace(amax / 32, amax / 2, 64).tolist()
    best = min(int8_mse(x, t) for t in grid)
    assert chosen < amax  # it clips the outliers
    assert int8_mse(x, chosen) <= 1.10 * best
    assert int8_mse(x, chosen) < int8_mse(x, amax)


def test_histogram_kl_clips_outliers():
    x = heavy_tailed(3)
    obs = RangeObserver("histogram")
    obs.update(x)
    chosen = obs.result().item()
    assert 2.0 < chosen < x.abs().max().item() / 2  # keeps the bulk (|x| < ~4), drops the tails


def test_observe_linears_sees_each_linear_input():
    model = tiny_model("llama")
    layer = model.model.layers[0]
    captured: dict[str, list[torch.Tensor]] = {"self_attn.o_proj": [], "mlp.down_proj": []}
    handles = [layer.get_submodule(n).register_forward_pre_hook(lambda m, a, n=n: captured[n].append(a[0]))
               for n in captured]
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with observe_linears(layer, list(captured), lambda: RangeObserver("absmax", per_channel=True)) as obs:
        with torch.no_grad():
            model(ids)
    for h in handles:
        h.remove()
    for name, xs in captured.items():
        direct = torch.cat([x.reshape(-1, x.shape[-1]) for x in xs]).abs().amax(dim=0)
        assert torch.equal(obs.inputs[name].result(), direct)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_kv_observer_is_per_kv_head_absmax_after_rope(model_type: str):
    """Recompute K (k_proj, then RoPE) and V by hand from the attention module's inputs."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = tiny_model(model_type)
    attn = model.model.layers[1].self_attn
    seen: dict = {}

    def grab(_m, args, kwargs):
        seen["h"] = kwargs.get("hidden_states", args[0] if args else None)
        seen["pos"] = kwargs["position_embeddings"]

    handle = attn.register_forward_pre_hook(grab, with_kwargs=True)
    kv_cache.enable(model)
    ids = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(4))
    with kv_cache.observe_kv(attn) as rng, torch.no_grad():
        model(ids)
    handle.remove()
    h, (cos, sin) = seen["h"], seen["pos"]
    b, length, _ = h.shape
    d = attn.head_dim
    with torch.no_grad():
        q = attn.q_proj(h).view(b, length, -1, d).transpose(1, 2)
        k = attn.k_proj(h).view(b, length, -1, d).transpose(1, 2)
        v = attn.v_proj(h).view(b, length, -1, d).transpose(1, 2)
        _, k = apply_rotary_pos_emb(q, k, cos, sin)
    assert rng.k.shape == (model.config.num_key_value_heads,)
    torch.testing.assert_close(rng.k, k.abs().amax(dim=(0, 2, 3)))
    torch.testing.assert_close(rng.v, v.abs().amax(dim=(0, 2, 3)))
