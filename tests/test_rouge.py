"""ROUGE scoring (quantlab.eval.rouge) against direct computations on tiny inputs, Chinese
scored by character, the paired bootstrap, and summarization prompts (quantlab.eval.summaries)."""

from __future__ import annotations

import numpy as np
import pytest

from quantlab.eval import rouge, summaries


def f1(matches: int, predicted: int, reference: int) -> float:
    p, r = matches / predicted, matches / reference
    return 0.0 if matches == 0 else 2 * p * r / (p + r)


def lcs(a: list[str], b: list[str]) -> int:
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            table[i + 1][j + 1] = table[i][j] + 1 if x == y else max(table[i][j + 1], table[i + 1][j])
    return table[-1][-1]


def test_word_rouge_matches_the_direct_counts():
    prediction, reference = "the cat sat on a red mat", "a cat sat on the mat today"
    pred, ref = prediction.split(), reference.split()
    got = rouge.score([prediction], [reference], "words").sample(0)
    unigrams = sum(min(pred.count(w), ref.count(w)) for w in set(pred))
    bigrams_p, bigrams_r = list(zip(pred, pred[1:])), list(zip(ref, ref[1:]))
    bigrams = sum(min(bigrams_p.count(b), bigrams_r.count(b)) for b in set(bigrams_p))
    assert got["rouge1"] == pytest.approx(100 * f1(unigrams, len(pred), len(ref)), abs=1e-3)
    assert got["rouge2"] == pytest.approx(100 * f1(bigrams, len(bigrams_p), len(bigrams_r)), abs=1e-3)
    assert got["rougeL"] == pytest.approx(100 * f1(lcs(pred, ref), len(pred), len(ref)), abs=1e-3)


def test_chinese_is_scored_by_character_and_the_words_tokenizer_would_score_zero():
    prediction, reference = "林志颖公司涉嫌虚假营销", "林志颖公司疑涉虚假营销无厂房无研发"
    words = rouge.score([prediction], [reference], "words").mean()
    assert all(v == 0 for v in words.values())  # rouge-score's stock tokenizer keeps only [a-z0-9]
    assert rouge.choose_tokenize("auto", [reference]) == "chars"
    chars = rouge.score([prediction], [reference], rouge.choose_tokenize("auto", [reference])).sample(0)
    p, r = list(prediction), list(reference)
    assert chars["rouge1"] == pytest.approx(100 * f1(sum(min(p.count(c), r.count(c)) for c in set(p)), len(p), len(r)),
                                            abs=1e-3)
    assert chars["rougeL"] == pytest.approx(100 * f1(lcs(p, r), len(p), len(r)), abs=1e-3) and chars["rouge1"] > 0


def test_auto_keeps_words_for_english_and_mixed_text_keeps_latin_words_whole():
    assert rouge.choose_tokenize("auto", ["The cat sat.", "Prices rose 3%."]) == "words"
    assert rouge.CharTokenizer().tokenize("GPT4模型 Qwen2") == ["gpt4", "模", "型", "qwen2"]


def test_rouge_lsum_reads_one_sentence_per_line():
    assert rouge.sentences_per_line("One. Two! Three?") == "One.\nTwo!\nThree?"
    assert rouge.sentences_per_line("第一句。第二句。") == "第一句。\n第二句。"
    assert rouge.sentences_per_line("Kept as\nit is") == "Kept as\nit is"


def test_paired_bootstrap_interval():
    rng = np.random.default_rng(0)
    base = rouge.Scores("words", {k: rng.uniform(0.1, 0.5, 50) for k in rouge.ROUGE_TYPES})
    same = rouge.paired_difference(base, base)
    assert all(d == {"mean": 0.0, "ci95": [0.0, 0.0]} for d in same.values())
    shifted = rouge.Scores("words", {k: v + 0.02 for k, v in base.per_sample.items()})
    assert rouge.paired_difference(shifted, base)["rouge1"] == {"mean": 2.0, "ci95": [2.0, 2.0]}
    noisy = rouge.Scores("words", {k: v + rng.normal(0, 0.05, 50) for k, v in base.per_sample.items()})
    d = rouge.paired_difference(noisy, base, resamples=2000)["rouge1"]
    assert d["ci95"][0] < d["mean"] < d["ci95"][1] and d["ci95"][1] - d["ci95"][0] < 4


def test_prompt_cuts_the_document_and_keeps_the_instruction(tokenizer):
    document = " ".join(["word"] * 400)
    text = summaries.build_prompt(document, tokenizer, "plain", None, max_input_tokens=50)
    assert text.endswith("\nTL;DR:") and len(tokenizer(text).input_ids) <= 50 + 10
    custom = summaries.build_prompt("short text", tokenizer, "plain", "Article: {document}\nSummary:", 50)
    assert custom == "Article: short text\nSummary:"
    assert summaries.prompt_style("auto", tokenizer) == "plain"  # no chat template


def test_batches_are_cut_by_length_and_outputs_come_back_in_prompt_order():
    prompts = [summaries.Prompt(i, "", [1] * n, "") for i, n in enumerate([5, 1, 9, 3, 7])]
    seen = []

    def echo(batch: list[list[int]]) -> list[list[int]]:
        seen.append([len(p) for p in batch])
        return [[len(p), 0, 99] for p in batch]

    done = summaries.generate_all(echo, prompts, batch_size=2, stop=[0])
    assert seen == [[1, 3], [5, 7], [9]]
    assert done.tokens == [[5], [1], [9], [3], [7]]  # cut at the stop token
    assert summaries.pick(3, 10, None) == [0, 1, 2] and summaries.pick(3, 10, 7) == summaries.pick(3, 10, 7)
