"""Text sources: local text/JSON/Parquet files, chat rendering, and offline hub errors."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from quantlab.data.sources import check_source, load_documents
from quantlab.errors import UserError
from quantlab.recipe import DatasetSpec
from conftest import REPO, SHARED_DATA

ALPACA = SHARED_DATA / "chat_instruct" / "alpaca_en_demo_999.json"
C4 = SHARED_DATA / "c4" / "c4_demo_300docs.jsonl"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
)
RECORDS = [{"body": "first document", "id": 1}, {"body": "second\nhas two lines", "id": 2},
           {"body": "third", "id": 3}]


def load(source: Path | str, **fields) -> list[str]:
    return load_documents(DatasetSpec(source=str(source), **fields), "calibration.dataset")


@pytest.mark.parametrize("suffix", [".txt", ".raw"])
def test_text_lines_are_documents_with_newlines_kept(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"data{suffix}"
    path.write_text(" = Title = \n\nBody line one .\nBody line two", encoding="utf-8")
    assert load(path) == [" = Title = \n", "\n", "Body line one .\n", "Body line two"]
    assert load(path, max_documents=2) == [" = Title = \n", "\n"]


def test_real_wikitext_file_is_rows_like_hf_wikitext() -> None:
    docs = load(SHARED_DATA / "wikitext-2-raw-v1" / "wiki.test.raw", max_documents=50)
    assert len(docs) == 50 and all(d.endswith("\n") for d in docs)
    assert "".join(docs) == (SHARED_DATA / "wikitext-2-raw-v1" / "wiki.test.raw").read_text(encoding="utf-8")[
        : len("".join(docs))]


def test_jsonl_with_text_field(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    assert load(path, text_field="body") == [r["body"] for r in RECORDS]


def test_json_list_with_text_field(tmp_path: Path) -> None:
    path = tmp_path / "data.json"
    path.write_text(json.dumps(RECORDS))
    assert load(path, text_field="body", max_documents=2) == ["first document", "second\nhas two lines"]


def test_parquet_with_text_field(tmp_path: Path) -> None:
    pd = pytest.importorskip("pandas")
    path = tmp_path / "data.parquet"
    pd.DataFrame(RECORDS).to_parquet(path)
    assert load(path, text_field="body") == [r["body"] for r in RECORDS]


def test_real_c4_jsonl_default_text_field() -> None:
    docs = load(C4, max_documents=5)
    first = json.loads(C4.read_text(encoding="utf-8").splitlines()[0])
    assert len(docs) == 5 and docs[0] == first["text"]


def test_missing_text_field_names_field_and_lists_fields(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    with pytest.raises(UserError) as info:
        load(path, text_field="content")
    message = str(info.value)
    assert message.startswith("calibration.dataset.text_field: ")
    assert "'content'" in message and "fields: body, id" in message


def test_empty_file_holds_no_text(tmp_path: Path) -> None:
    path = tmp_path / "blank.txt"
    path.write_text("\n\n   \n")
    with pytest.raises(UserError, match=r"^calibration\.dataset\.source: .* holds no text"):
        load(path)


@pytest.fixture()
def chat_tokenizer(tokenizer):
    """A copy of the tiny tokenizer with a simple chat template (the session one stays plain)."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def test_alpaca_chat_rendered_through_template(chat_tokenizer) -> None:
    spec = DatasetSpec(source=str(ALPACA), format="chat", max_documents=3)
    docs = load_documents(spec, "calibration.dataset", chat_tokenizer)
    records = json.loads(ALPACA.read_text(encoding="utf-8"))[:3]
    assert len(docs) == 3
    for doc, record in zip(docs, records):
        prompt = record["instruction"] + (f"\n\n{record['input']}" if record.get("input") else "")
        assert doc == f"<|user|>\n{prompt}<|end|>\n<|assistant|>\n{record['output']}<|end|>\n"


def test_messages_chat_records(tmp_path: Path, chat_tokenizer) -> None:
    path = tmp_path / "chat.jsonl"
    conv = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "hello"}]}
    sharegpt = {"conversations": [{"from": "user", "value": "q"}, {"from": "assistant", "value": "a"}]}
    path.write_text(json.dumps(conv) + "\n" + json.dumps(sharegpt) + "\n")
    docs = load_documents(DatasetSpec(source=str(path), format="chat"), "calibration.dataset", chat_tokenizer)
    assert docs == ["<|system|>\nbe brief<|end|>\n<|user|>\nhi<|end|>\n<|assistant|>\nhello<|end|>\n",
                    "<|user|>\nq<|end|>\n<|assistant|>\na<|end|>\n"]


def test_chat_without_template_or_conversation_fields(tmp_path: Path, tokenizer, chat_tokenizer) -> None:
    spec = DatasetSpec(source=str(ALPACA), format="chat", max_documents=1)
    with pytest.raises(UserError, match=r"^calibration\.dataset\.format: .*chat template"):
        load_documents(spec, "calibration.dataset", tokenizer)
    path = tmp_path / "plain.jsonl"
    path.write_text(json.dumps({"text": "not a chat"}) + "\n")
    with pytest.raises(UserError, match=r"^calibration\.dataset\.format: .*fields: text"):
        load_documents(DatasetSpec(source=str(path), format="chat"), "calibration.dataset", chat_tokenizer)


def test_check_source_before_a_run(tmp_path: Path, monkeypatch) -> None:
    check_source(DatasetSpec(source=str(C4)), "calibration.dataset")  # exists: fine
    import datasets
    from huggingface_hub import constants

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf" / "datasets")  # empty caches
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr("quantlab.models.sources.hub_unreachable", lambda: None)
    check_source(DatasetSpec(source="wikitext2"), "calibration.dataset")  # a reachable hub: loaded later
    monkeypatch.setattr("quantlab.models.sources.hub_unreachable", lambda: "HF_HUB_OFFLINE is set")
    for source in ("wikitext2", "some-org/some-dataset"):  # offline and not cached: refused at once
        with pytest.raises(UserError, match=r"^calibration\.dataset\.source: .* hub is unreachable"):
            check_source(DatasetSpec(source=source), "calibration.dataset")
    (tmp_path / "hf" / "datasets" / "some-org___some-dataset").mkdir(parents=True)
    check_source(DatasetSpec(source="some-org/some-dataset"), "calibration.dataset")  # cached: fine
    with pytest.raises(UserError, match=r"^evaluate\.perplexity\.dataset\.source: file .* not found"):
        check_source(DatasetSpec(source=str(tmp_path / "nope.jsonl")), "evaluate.perplexity.dataset")
    odd = tmp_path / "data.csv"
    odd.write_text("text\nhello\n")
    with pytest.raises(UserError, match=r"^calibration\.dataset\.source: .* suffix '\.csv'"):
        check_source(DatasetSpec(source=str(odd)), "calibration.dataset")


OFFLINE_SOURCES = ["wikitext2", "some-org/some-dataset"]
OFFLINE_SCRIPT = """
from quantlab.data.sources import load_documents
from quantlab.errors import UserError
from quantlab.recipe import DatasetSpec
for source in %r:
    try:
        load_documents(DatasetSpec(source=source), "calibration.dataset")
    except UserError as exc:
        print(exc)
    else:
        print("LOADED")
""" % (OFFLINE_SOURCES,)


def test_hub_names_fail_offline_with_a_local_file_hint(tmp_path: Path) -> None:
    """A shortcut and a hub id, offline. Offline mode is read when `datasets` is imported, so
    this runs in a fresh interpreter."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run([sys.executable, "-c", OFFLINE_SCRIPT], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    messages = proc.stdout.splitlines()
    assert len(messages) == len(OFFLINE_SOURCES), proc.stdout
    for source, message in zip(OFFLINE_SOURCES, messages):
        assert message.startswith("calibration.dataset.source: could not load dataset")
        assert f"'{source}'" in message
        assert "point calibration.dataset.source at a local .txt/.jsonl/.json/.parquet file" in message


def test_token_demands_cover_calibration_perplexity_and_verify() -> None:
    """What preflight counts: each reader's minimum, BOS taking one token of each window."""
    from quantlab.data.sources import token_demands
    from quantlab.recipe import validate_recipe

    data = {"source": "/data/eval.txt"}
    recipe = validate_recipe({
        "name": "t", "seed": 0, "model": {"id": "/m"},
        "calibration": {"dataset": data, "num_samples": 4, "seq_len": 32, "strategy": "concat_chunk"},
        "stages": [{"rtn": {}}], "evaluate": {"perplexity": {"dataset": data, "seq_len": 64}},
        "verify": {"num_prompts": 3, "prompt_tokens": 10, "seq_len": 48}})
    needs = {(field, d.field): d.tokens for _, field, d in token_demands(recipe, bos=True)}
    assert needs == {("calibration.dataset", "calibration.num_samples"): 4 * 31,
                     ("evaluate.perplexity.dataset", "evaluate.perplexity.seq_len"): 63,
                     ("verify.dataset", "verify.num_prompts"): 30, ("verify.dataset", "verify.seq_len"): 47}


def test_local_summary_file_without_its_fields_is_refused_in_preflight(tmp_path: Path) -> None:
    from quantlab.data.sources import check_summary_pairs
    from quantlab.recipe import SummaryDataSpec

    path = tmp_path / "pairs.jsonl"
    path.write_text('{"body": "a text", "gist": "a summary"}\n')
    with pytest.raises(UserError, match=r"^evaluate\.rouge\.dataset\.document_field: none of article"):
        check_summary_pairs(SummaryDataSpec(source=str(path)), "evaluate.rouge.dataset")
    check_summary_pairs(SummaryDataSpec(source=str(path), document_field="body", reference_field="gist"),
                        "evaluate.rouge.dataset")
