"""ROUGE of generated summaries against references, in any script, with paired intervals.

Scoring is `rouge-score` (Google's reimplementation of the ROUGE-1.5.5 package, what
`evaluate.load("rouge")` wraps): F-measure of ROUGE-1, -2, -L and -Lsum (-L over the
summary's sentences joined, one per line). Its stock tokenizer keeps only `[a-z0-9]` runs,
so Chinese, Japanese or Thai text scores 0 whatever the model wrote. `tokenize`:

* `words`: the stock tokenizer with the Porter stemmer (English and other spaced scripts);
* `chars`: every character of an unsegmented script is a token, runs of Latin letters and
  digits stay words (the usual LCSTS protocol: Chinese ROUGE is scored by character);
* `auto`: `chars` when at least a fifth of the references' letters are in unsegmented scripts.

The difference between two models on the same samples gets a paired bootstrap interval:
resample the samples with replacement, take the mean of the per-sample differences, and
report its 2.5 and 97.5 percentiles (the test set is the noise; the pairing removes the
per-article difficulty both models share).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

Tokenize = Literal["auto", "words", "chars"]
ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")

# Han, Hiragana, Katakana, Thai, Lao, Myanmar, Khmer, Tibetan: written without spaces between words
UNSEGMENTED = re.compile(
    "[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\u0e00-\u0e7f\u0e80-\u0eff\u1000-\u109f"
    "\u1780-\u17ff\u0f00-\u0fff\U00020000-\U0002ffff]"
)
CHAR_TOKENS = re.compile(UNSEGMENTED.pattern + "|[a-z0-9]+")
SENTENCE_END = re.compile(r"(?<=[.!?。！？])\s+|(?<=[。！？])")


class CharTokenizer:
    """`rouge-score` tokenizer for unsegmented scripts: one token per such character."""

    def tokenize(self, text: str) -> list[str]:
        return CHAR_TOKENS.findall(text.lower())


def choose_tokenize(mode: Tokenize, references: Sequence[str]) -> Literal["words", "chars"]:
    if mode != "auto":
        return mode
    text = "".join(references)
    letters = sum(ch.isalnum() for ch in text)
    return "chars" if letters and len(UNSEGMENTED.findall(text)) >= 0.2 * letters else "words"


def sentences_per_line(text: str) -> str:
    """One sentence per line, which ROUGE-Lsum splits on (references usually come that way)."""
    if "\n" in text.strip():
        return text.strip()
    return "\n".join(s for s in SENTENCE_END.split(text.strip()) if s.strip())


@dataclass
class Scores:
    """Per-sample F-measures (0-1) of each ROUGE type, in sample order."""

    tokenize: str
    per_sample: dict[str, np.ndarray]

    def mean(self) -> dict[str, float]:
        """Means in points (0-100), as summarization papers and TensorRT-LLM report them."""
        return {k: round(100 * float(v.mean()), 4) if len(v) else 0.0 for k, v in self.per_sample.items()}

    def sample(self, i: int) -> dict[str, float]:
        return {k: round(100 * float(v[i]), 4) for k, v in self.per_sample.items()}

    @classmethod
    def of_rows(cls, rows: Sequence[dict[str, float]], tokenize: str) -> "Scores":
        """From per-sample rows holding each ROUGE type in points (as `sample` writes them)."""
        return cls(tokenize, {k: np.array([r[k] / 100 for r in rows], dtype=np.float64) for k in ROUGE_TYPES})


def score(predictions: Sequence[str], references: Sequence[str], tokenize: Literal["words", "chars"]) -> Scores:
    from rouge_score import rouge_scorer

    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    scorer = rouge_scorer.RougeScorer(
        list(ROUGE_TYPES), use_stemmer=tokenize == "words",
        tokenizer=CharTokenizer() if tokenize == "chars" else None)
    rows = [scorer.score(sentences_per_line(r), sentences_per_line(p)) for p, r in zip(predictions, references)]
    return Scores(tokenize, {k: np.array([row[k].fmeasure for row in rows], dtype=np.float64) for k in ROUGE_TYPES})


def paired_difference(candidate: Scores, reference: Scores, resamples: int = 1000,
                      seed: int = 0) -> dict[str, dict[str, float]]:
    """Mean of candidate − reference per ROUGE type in points, with its paired bootstrap 95% interval."""
    rng = np.random.default_rng(seed)
    n = len(next(iter(reference.per_sample.values())))
    picks = rng.integers(0, n, size=(resamples, n)) if n else np.zeros((0, 0), dtype=np.int64)
    out: dict[str, dict[str, float]] = {}
    for k in ROUGE_TYPES:
        diff = 100 * (candidate.per_sample[k] - reference.per_sample[k])
        means = diff[picks].mean(axis=1) if n else np.zeros(1)
        lo, hi = np.percentile(means, [2.5, 97.5])
        out[k] = {"mean": round(float(diff.mean()) if n else 0.0, 4), "ci95": [round(float(lo), 4), round(float(hi), 4)]}
    return out
