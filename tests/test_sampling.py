"""Calibration sampling: deterministic per seed, exact shapes, honest errors on too little data."""

from __future__ import annotations

import pytest
import torch

from quantlab.data.sampling import sample, tokenize_joined
from quantlab.errors import UserError
from quantlab.recipe import CalibrationSpec, DatasetSpec
from conftest import WIKI_TRAIN

STRATEGIES = ("random_windows", "concat_chunk", "per_document")


@pytest.fixture(scope="module")
def docs() -> list[str]:
    """The first 200 lines (~20k tokens) of WikiText-2 train, as the .raw loader returns them."""
    return WIKI_TRAIN.read_text(encoding="utf-8").splitlines(keepends=True)[:200]


def spec(strategy: str, num_samples: int = 6, seq_len: int = 48) -> CalibrationSpec:
    return CalibrationSpec(dataset=DatasetSpec(source=str(WIKI_TRAIN)), num_samples=num_samples,
                           seq_len=seq_len, strategy=strategy)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_shape_dtype_and_determinism(strategy: str, docs, tokenizer) -> None:
    a = sample(docs, tokenizer, spec(strategy), seed=0)
    b = sample(docs, tokenizer, spec(strategy), seed=0)
    c = sample(docs, tokenizer, spec(strategy), seed=1)
    assert a.input_ids.shape == (6, 48) and a.input_ids.dtype == torch.int64
    assert torch.equal(a.input_ids, b.input_ids)
    assert not torch.equal(a.input_ids, c.input_ids)
    assert a.source_tokens > 6 * 48
    assert int(a.input_ids.max()) < len(tokenizer)


def _find(stream: torch.Tensor, window: torch.Tensor) -> list[int]:
    starts = (stream[: stream.numel() - window.numel() + 1] == window[0]).nonzero().flatten().tolist()
    return [s for s in starts if torch.equal(stream[s : s + window.numel()], window)]


def test_random_windows_are_slices_of_the_joined_stream(docs, tokenizer) -> None:
    stream = tokenize_joined(docs, tokenizer)
    calib = sample(docs, tokenizer, spec("random_windows"), seed=3)
    assert calib.source_tokens == stream.numel()
    for window in calib.input_ids:
        assert _find(stream, window), "window is not a contiguous slice of the stream"


def test_concat_chunk_windows_are_aligned_and_distinct(docs, tokenizer) -> None:
    stream = tokenize_joined(docs, tokenizer)
    calib = sample(docs, tokenizer, spec("concat_chunk", num_samples=10, seq_len=32), seed=5)
    starts = []
    for window in calib.input_ids:
        aligned = [s for s in _find(stream, window) if s % 32 == 0]
        assert aligned, "window does not start on a chunk boundary"
        starts.append(aligned[0])
    assert len(set(starts)) == 10  # no chunk used twice
    assert starts == sorted(starts)


def test_per_document_windows_are_document_prefixes(docs, tokenizer) -> None:
    calib = sample(docs, tokenizer, spec("per_document", num_samples=5, seq_len=40), seed=2)
    prefixes = {tuple(tokenizer(d, add_special_tokens=False).input_ids[:40]) for d in docs}
    for window in calib.input_ids:
        assert tuple(window.tolist()) in prefixes
    assert len({tuple(w.tolist()) for w in calib.input_ids}) == 5


def test_concat_chunk_too_little_data_names_num_samples(docs, tokenizer) -> None:
    few = docs[:12]
    chunks = tokenize_joined(few, tokenizer).numel() // 64
    with pytest.raises(UserError, match=r"^calibration\.num_samples: .*"):
        sample(few, tokenizer, spec("concat_chunk", num_samples=chunks + 1, seq_len=64), seed=0)
    assert sample(few, tokenizer, spec("concat_chunk", num_samples=chunks, seq_len=64), seed=0).input_ids.shape[0] == chunks


def test_per_document_too_few_long_documents_names_num_samples(docs, tokenizer) -> None:
    with pytest.raises(UserError, match=r"^calibration\.num_samples: 50 documents of at least 400 tokens"):
        sample(docs[:60], tokenizer, spec("per_document", num_samples=50, seq_len=400), seed=0)


def test_random_windows_stream_shorter_than_window_names_seq_len(tokenizer) -> None:
    tiny = ["A very short document .\n"]
    with pytest.raises(UserError, match=r"^calibration\.seq_len: 64 tokens per sample"):
        sample(tiny, tokenizer, spec("random_windows", num_samples=2, seq_len=64), seed=0)


@pytest.fixture(scope="module")
def bos_tokenizer(tokenizer):
    """The tiny tokenizer, made to start every text with a BOS token (as Gemma's and Llama 3's do)."""
    import copy

    from tokenizers import processors

    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"bos_token": "<|endoftext|>"})
    bos = tok.bos_token_id
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                                 special_tokens=[("<|endoftext|>", bos)])
    assert tok("a").input_ids[0] == bos
    return tok


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_windows_start_with_bos_when_the_tokenizer_adds_it(strategy, docs, tokenizer, bos_tokenizer) -> None:
    from quantlab.data.sampling import bos_prefix

    bos = bos_prefix(bos_tokenizer)
    assert bos is not None and bos_prefix(tokenizer) is None
    ids = sample(docs, bos_tokenizer, spec(strategy), seed=0).input_ids
    assert ids.shape == (6, 48) and (ids[:, 0] == bos).all() and not (ids[:, 1:] == bos).all(dim=1).any()


def test_perplexity_windows_with_bos_score_every_stream_token(docs, bos_tokenizer) -> None:
    from quantlab.data.sampling import bos_prefix
    from quantlab.eval.perplexity import windows_of

    stream = tokenize_joined(docs, bos_tokenizer)
    bos = bos_prefix(bos_tokenizer)
    windows = windows_of(stream, 48, 3, bos)
    assert windows.shape == (3, 48) and (windows[:, 0] == bos).all()
    assert torch.equal(windows[:, 1:].flatten(), stream[: 3 * 47])  # consecutive, none skipped
    assert torch.equal(windows_of(stream, 48, 3), stream[: 3 * 48].view(3, 48))


def test_overlapping_random_windows_warn_in_one_line_and_sample_as_before(docs, tokenizer, capsys) -> None:
    """64 × 100 tokens from a few hundred: allowed (same windows as without the warning), but said."""
    few = docs[:8]
    have = tokenize_joined(few, tokenizer).numel()
    assert 100 < have < 64 * 100
    calib = sample(few, tokenizer, spec("random_windows", num_samples=64, seq_len=100), seed=0)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"need 6400 tokens but the data has {have}" in err, err
    stream = tokenize_joined(few, tokenizer)
    starts = torch.randint(0, have - 100, (64,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(calib.input_ids, torch.stack([stream[s: s + 100] for s in starts.tolist()]))
    sample(docs, tokenizer, spec("random_windows"), seed=0)
    assert capsys.readouterr().err == ""  # enough data: no warning


def test_tokens_at_least_is_exact_below_the_need(docs, tokenizer) -> None:
    from quantlab.data.sampling import tokens_at_least

    total = tokenize_joined(docs, tokenizer).numel()
    assert tokens_at_least(docs, tokenizer, total + 1) == total  # not enough: the exact count
    assert tokens_at_least(docs, tokenizer, 100) >= 100  # enough: counted on a prefix only
