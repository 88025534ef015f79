"""Damaged or unexpected data files end in one line naming the file, before any run directory
exists (`check_source` reads each local file's head in preflight) or, for what only a full read
shows, when the documents are loaded; records without text never become the string "None"."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from quantlab.cli import app
from quantlab.data.sources import check_source, load_documents
from quantlab.errors import UserError
from quantlab.file_checks import check_gguf, check_safetensors
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


def _gguf(*fields: bytes) -> bytes:
    return b"GGUF" + b"".join(fields)


CRAFTED = {
    "random.gguf": bytes(range(256)) * 16,
    "truncated.gguf": _gguf(struct.pack("<IQQ", 3, 1, 1)),
    "array.gguf": _gguf(struct.pack("<IQQ", 3, 0, 1), struct.pack("<Q", 3), b"key", struct.pack("<IIQ", 9, 0, 2**61)),
    "string.gguf": _gguf(struct.pack("<IQQ", 3, 0, 1), struct.pack("<Q", 2**60)),
    "tensors.gguf": _gguf(struct.pack("<IQQ", 3, 2**62, 0)),
    "header.safetensors": struct.pack("<Q", 2**62) + b"{}",
    "offsets.safetensors": struct.pack("<Q", 61) + b'{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,1000000]}}',
}


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_crafted_binary_headers_end_in_one_line(tmp_path: Path, name: str) -> None:
    """Declared sizes are checked against the file before any reader allocates (file_checks)."""
    (tmp_path / name).write_bytes(CRAFTED[name])
    check = check_gguf if name.endswith(".gguf") else check_safetensors
    with pytest.raises(UserError, match="damaged or not what its name says"):
        check(tmp_path / name)


def test_inspect_of_a_crafted_gguf_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "model.gguf").write_bytes(CRAFTED["array.gguf"])
    result = CliRunner().invoke(app, ["inspect", str(tmp_path / "model.gguf")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "model.gguf" in result.stderr
