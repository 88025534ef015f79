"""Damaged or unexpected data files end in one line naming the file, before any run directory
exists (`check_source` reads each local file's head in preflight) or, for what only a full read
shows, when the documents are loaded; records without text never become the string "None"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantlab.data.sources import check_source, load_documents
from quantlab.errors import UserError
from quantlab.recipe import DatasetSpec


@pytest.mark.parametrize("name, content, why", [
    ("empty.txt", b"", "is empty"),
    ("latin1.txt", "caf\u00e9 au lait\n".encode("latin-1"), "not UTF-8"),
    ("binary.txt", b"text\x00\x01\x02more", "binary data"),
    ("bad.jsonl", b"{not json}\n", "line 1 is not a JSON object"),
    ("list.jsonl", b"[1, 2]\n", "line 1 is not a JSON object"),
    ("fake.parquet", b"not parquet at all", "not a Parquet file"),
])
def test_preflight_refuses_what_cannot_be_the_format(tmp_path: Path, name: str, content: bytes, why: str) -> None:
    (tmp_path / name).write_bytes(content)
    with pytest.raises(UserError, match=why):
        check_source(DatasetSpec(source=str(tmp_path / name)), "calibration.dataset")


def test_a_directory_is_named_as_one(tmp_path: Path) -> None:
    (tmp_path / "data.txt").mkdir()
    with pytest.raises(UserError, match="is a directory"):
        check_source(DatasetSpec(source=str(tmp_path / "data.txt")), "calibration.dataset")


def test_a_malformed_later_line_and_null_text(tmp_path: Path) -> None:
    bad = tmp_path / "later.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n{broken\n")
    with pytest.raises(UserError, match="later.jsonl"):
        load_documents(DatasetSpec(source=str(bad)), "calibration.dataset")
    nulls = tmp_path / "nulls.jsonl"
    nulls.write_text("\n".join(json.dumps({"text": t}) for t in ["a doc", None, "another"]) + "\n")
    assert load_documents(DatasetSpec(source=str(nulls)), "calibration.dataset") == ["a doc", "another"]
