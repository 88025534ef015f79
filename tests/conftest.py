"""Shared fixtures: tiny random models of each family, a tiny tokenizer, the shared data dir."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from quantlab.checkout import drop_checkout_root

drop_checkout_root()  # `python -m pytest` from the root: `kernels/` must not pass for HF's `kernels`

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
WIKI_TRAIN = SHARED_DATA / "wikitext-2-raw-v1" / "wiki.train.first1MB.raw"
WIKI_TEST = SHARED_DATA / "wikitext-2-raw-v1" / "wiki.test.raw"

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tests write their runs under pytest's temporary directories, outside the runs root (the
# current directory); tests/test_confinement.py checks the root with this unset.
os.environ["QUANTLAB_ALLOW_OUTSIDE"] = "1"

# Property tests explore the same examples on every run: a CI failure reproduces locally.
from hypothesis import settings  # noqa: E402

settings.register_profile("quantlab", derandomize=True, deadline=None)
settings.load_profile("quantlab")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


# Measurements, which differ between any two runs of one recipe: durations, memory peaks and
# the size on disk (quant_config.json and the reports hold them).
MEASURED = re.compile(r"seconds$|^peak_|^size_bytes$")


def unmeasured(value: object) -> object:
    """A JSON value without its measurements (`MEASURED` keys, at any depth)."""
    if isinstance(value, dict):
        return {k: unmeasured(v) for k, v in value.items() if not MEASURED.search(k)}
    if isinstance(value, list):
        return [unmeasured(v) for v in value]
    return value


# Per family: mixture-of-experts families get 4 experts, 2 per token (Qwen2-MoE's shared
# expert is wider); families whose default head_dim is not hidden / heads get 16; Gemma 3 gets
# one sliding-window layer (window 8) and one global layer with RoPE theta as the real model's.
TINY_FAMILY = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64),
    "qwen3": dict(head_dim=16),
    "qwen3_moe": dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "gemma3_text": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                        layer_types=["sliding_attention", "full_attention"]),
}


def tiny_config(model_type: str = "llama", **overrides):
    """A 2-layer config with GQA (4 heads, 2 KV heads) small enough for unit tests."""
    from transformers import AutoConfig

    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=512, max_position_embeddings=256,
                tie_word_embeddings=model_type in ("llama", "gemma3_text"), **TINY_FAMILY.get(model_type, {}))
    base.update(overrides)
    return AutoConfig.for_model(model_type, **base)


def tiny_model(model_type: str = "llama", seed: int = 0, **overrides) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), dtype=torch.float32)
    return model.eval()


def tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE trained on a slice of WikiText, wrapped as a transformers tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = WIKI_TRAIN.read_text(encoding="utf-8")[:200_000].splitlines()
    tok.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


@pytest.fixture
def one_thread():
    """Tiny tensors: on a shared CPU a second OpenMP thread only adds sync stalls (measured 10×
    slower under load). Modules use it with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer) -> Path:
    """A saved tiny llama checkpoint with a tokenizer, usable as `model.id` in recipes."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# ----------------------------------------------------------------------------- real SmolLM2 runs


def pytest_configure(config):
    config.addinivalue_line("markers", "smollm2(*cases): reads these shared real-SmolLM2 runs (tests/smollm2_runs.py)")


def pytest_collection_modifyitems(config, items):
    """Tests that read the shared SmolLM2 runs go last, so the unit tests run while the runs do
    instead of waiting behind a test that waits for its run."""
    items.sort(key=lambda item: item.get_closest_marker("smollm2") is not None)


@pytest.fixture(scope="session", autouse=True)
def smollm2_pool(request, tmp_path_factory):
    """Starts, at the beginning of the session, every shared SmolLM2 run a selected test reads,
    so they run beside the unit tests (tests/smollm2_runs.py)."""
    wanted = {case for item in request.session.items for mark in item.iter_markers("smollm2") for case in mark.args}
    if not wanted:
        yield None
        return
    from smollm2_runs import SmolLM2Runs

    runs = SmolLM2Runs(tmp_path_factory.mktemp("smollm2"))
    torch.set_num_threads(1)  # two one-thread runs already fill the two cores
    runs.start(wanted)
    yield runs
    runs.close()


@pytest.fixture
def smollm2(smollm2_pool):
    """`smollm2(case_id)` waits for that shared run and returns it."""
    assert smollm2_pool is not None, "mark the test with @pytest.mark.smollm2(...)"
    return smollm2_pool.get
