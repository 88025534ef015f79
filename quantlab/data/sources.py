"""Text sources for calibration and evaluation: documents as a list of strings.

`dataset.source` is one of
  * a shortcut from `quantlab.calib_data/shortcuts.yaml` (wikitext2, c4, pileval, cnn_dailymail, lcsts),
  * `modelscope:<org>/<name>` (needs the `modelscope` extra),
  * a local `.txt` (one document per line, newline kept: the rows of HF wikitext) or
    `.jsonl` / `.json` / `.parquet` file with a text field,
  * any other Hugging Face `datasets` hub id.
With `format: chat`, records are conversations (`messages` lists, or alpaca-style
`instruction`/`input`/`output`) rendered through the tokenizer's chat template.
"""

from __future__ import annotations

import codecs
import contextlib
import importlib.resources
import json
from functools import cache
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import yaml

from quantlab.data.sampling import TokenDemand, bos_prefix, calibration_demand, tokens_at_least
from quantlab.errors import UserError
from quantlab.recipe import DatasetSpec, Recipe, SummaryDataSpec, verify_dataset

LOCAL_SUFFIXES = {".txt", ".raw", ".jsonl", ".json", ".parquet"}


@cache
def shortcuts() -> dict[str, dict[str, Any]]:
    text = importlib.resources.files("quantlab.calib_data").joinpath("shortcuts.yaml").read_text()
    return yaml.safe_load(text)


def is_local(source: str) -> bool:
    return Path(source).suffix in LOCAL_SUFFIXES or source.startswith((".", "/", "~")) or Path(source).exists()


def check_source(spec: DatasetSpec | SummaryDataSpec, field: str) -> None:
    """Checks done before a run starts: a local file must exist and have a known suffix; a hub
    dataset must be reachable or in the local cache."""
    if spec.source.startswith("modelscope:"):
        from quantlab.models.sources import require_modelscope

        require_modelscope(f"{field}.source")
        return
    if spec.source in shortcuts() or not is_local(spec.source):
        _check_hub_dataset(spec.source, field)
        return
    path = Path(spec.source).expanduser()
    if path.is_dir():
        raise UserError(f"{field}.source: {spec.source!r} is a directory; give a "
                        f"{'/'.join(sorted(LOCAL_SUFFIXES))} file")
    if not path.is_file():
        raise UserError(f"{field}.source: file {spec.source!r} not found; give an existing "
                        f"{'/'.join(sorted(LOCAL_SUFFIXES))} file, a hub dataset id, or one of: "
                        f"{', '.join(shortcuts())}")
    if path.suffix not in LOCAL_SUFFIXES:
        raise UserError(f"{field}.source: {spec.source!r} has suffix {path.suffix!r}; "
                        f"local files must be one of {', '.join(sorted(LOCAL_SUFFIXES))}")
    check_head(path, f"{field}.source")


def _check_hub_dataset(source: str, field: str) -> None:
    """A hub dataset (or a shortcut to one) when the hub does not answer: refused at once
    unless a local cache holds it, instead of the ~47 s of retries `datasets` makes before its
    error, after the run directory exists."""
    from quantlab.models.sources import hub_unreachable

    repo = shortcuts().get(source, {}).get("path", source)
    why = hub_unreachable()
    if why and not _dataset_cached(repo):
        raise UserError(f"{field}.source: {source!r} is not a local file and the dataset hub is unreachable "
                        f"({why}); give a local {'/'.join(sorted(LOCAL_SUFFIXES))} file")


def _dataset_cached(repo: str) -> bool:
    """Whether the Hugging Face hub cache or the `datasets` cache holds some copy of `repo`."""
    import datasets
    from huggingface_hub import constants

    hub = Path(constants.HF_HUB_CACHE) / f"datasets--{repo.replace('/', '--')}"
    prepared = Path(datasets.config.HF_DATASETS_CACHE) / repo.replace("/", "___")
    return hub.is_dir() or prepared.is_dir()


HEAD_BYTES = 1 << 16  # what preflight reads of a local data file


def check_head(path: Path, field: str) -> None:
    """Read the start of a local data file and refuse what cannot be its format, before a run
    directory exists: empty, not UTF-8 or binary text, a JSON Lines file whose first record is
    not a JSON object, a Parquet file without its magic number."""
    with path.open("rb") as handle:
        head = handle.read(HEAD_BYTES)
    if not head.strip():
        raise UserError(f"{field}: {str(path)!r} is empty")
    if path.suffix == ".parquet":
        if not head.startswith(b"PAR1"):
            raise UserError(f"{field}: {str(path)!r} is not a Parquet file (no PAR1 magic)")
        return
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < HEAD_BYTES)
    except UnicodeDecodeError as exc:
        raise UserError(f"{field}: {str(path)!r} is not UTF-8 text (byte {exc.start}); give UTF-8 text") from None
    if "\x00" in text:
        raise UserError(f"{field}: {str(path)!r} holds binary data (NUL bytes), not text")
    if path.suffix == ".jsonl":
        first = next((line for line in text.splitlines() if line.strip()), "")
        try:
            record = json.loads(first)
        except (ValueError, RecursionError):  # RecursionError: `[[[…` nested past the parser's stack
            record = None
        if not isinstance(record, dict):
            raise UserError(f"{field}: {str(path)!r} line 1 is not a JSON object; JSON Lines hold one object per line")


def token_demands(recipe: Recipe, bos: bool) -> list[tuple[DatasetSpec, str, TokenDemand]]:
    """(source, its field, the least it must yield) for each reader of token windows: the
    calibration sampler, the perplexity windows, the verify stage's prompts and windows.
    (ROUGE cuts documents to max_input_tokens: any non-empty record will do.)"""
    demands = []
    if recipe.calibration:
        demands.append((recipe.calibration.dataset, "calibration.dataset", calibration_demand(recipe.calibration, bos)))
    ppl = recipe.evaluate.perplexity
    if ppl:
        demands.append((ppl.dataset, "evaluate.perplexity.dataset", TokenDemand(
            "evaluate.perplexity.seq_len", ppl.seq_len - bos, f"one window of {ppl.seq_len} tokens",
            "lower seq_len or use a larger dataset")))
    verify, data = recipe.verify, verify_dataset(recipe)
    if verify and data and not verify.prompts:
        demands.append((data, "verify.dataset", TokenDemand(
            "verify.num_prompts", verify.num_prompts * verify.prompt_tokens,
            f"num_prompts × prompt_tokens = {verify.num_prompts} × {verify.prompt_tokens}",
            "lower them or use more text")))
    if verify and data and verify.perplexity_windows:
        demands.append((data, "verify.dataset", TokenDemand(
            "verify.seq_len", verify.seq_len - bos, f"one window of {verify.seq_len} tokens",
            "lower verify.seq_len or set verify.perplexity_windows: 0")))
    return demands


def check_token_supply(recipe: Recipe, tokenizer_of: Callable[[], Any | None]) -> Any | None:
    """Refuse, before calibration and before a run directory exists, a local data file that
    yields too few tokens for what reads it (`token_demands`): otherwise an evaluation source
    too short for one window is found only after calibrating and quantizing. `tokenizer_of`
    gives the model's tokenizer where it is on disk (None: not checked), and is called only
    when a local file is read. Each file is read once; sources needing a download are left
    to the run. Returns the tokenizer it loaded (None: none), for the run to reuse."""
    def local(spec: DatasetSpec) -> bool:
        return spec.source not in shortcuts() and is_local(spec.source)

    tokenizer = tokenizer_of() if any(local(spec) for spec, _, _ in token_demands(recipe, False)) else None
    if tokenizer is None:
        return None
    docs: dict[str, list[str]] = {}
    for spec, field, demand in token_demands(recipe, bos_prefix(tokenizer) is not None):
        if not local(spec):
            continue
        key = spec.model_dump_json()
        if key not in docs:
            docs[key] = load_documents(spec, field, tokenizer)
        demand.check(spec.source, tokens_at_least(docs[key], tokenizer, demand.tokens))
    return tokenizer


def load_documents(spec: DatasetSpec, field: str, tokenizer: Any = None) -> list[str]:
    """The documents of a source, in order, limited to `max_documents`."""
    if spec.source.endswith((".txt", ".raw")) and spec.format == "text":
        try:
            docs = Path(spec.source).expanduser().read_text(encoding="utf-8").splitlines(keepends=True)
        except UnicodeDecodeError as exc:
            raise UserError(f"{field}.source: {spec.source!r} is not UTF-8 text (byte {exc.start}); "
                            "give UTF-8 text") from None
    else:
        records = _records(spec, field)
        docs = list(_render(records, spec, field, tokenizer))
    if spec.max_documents:
        docs = docs[: spec.max_documents]
    if not any(d.strip() for d in docs):
        raise UserError(f"{field}.source: {spec.source!r} holds no text")
    return docs


DOCUMENT_FIELDS = ("article", "document", "text", "content", "source")
REFERENCE_FIELDS = ("highlights", "summary", "reference", "target", "abstract")


def load_summary_pairs(spec: SummaryDataSpec, field: str) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """(document, reference) pairs of a summarization set, in order, and the fields and split read."""
    short = shortcuts().get(spec.source, {})
    split = spec.split or short.get("eval_split", "validation")
    records = _records(DatasetSpec(source=spec.source, subset=spec.subset, split=split), field)
    columns = list(getattr(records, "column_names", None) or (next(iter(records), {}) or {}))
    doc = _pick_field(spec.document_field or short.get("document_field"), DOCUMENT_FIELDS, columns,
                      f"{field}.document_field", spec.source)
    ref = _pick_field(spec.reference_field or short.get("reference_field"), REFERENCE_FIELDS, columns,
                      f"{field}.reference_field", spec.source)
    pairs = [(str(r[doc]), str(r[ref])) for r in records]
    if not pairs:
        raise UserError(f"{field}.source: {spec.source!r} (split {split!r}) holds no records")
    return pairs, {"document_field": doc, "reference_field": ref, "split": None if is_local(spec.source) else split}


def check_summary_pairs(spec: SummaryDataSpec, field: str) -> None:
    """Read a local summarization file in preflight: its records and document / reference
    fields are otherwise first looked at after calibrating and quantizing. Hub sources are left
    to the run (a download)."""
    if spec.source not in shortcuts() and is_local(spec.source):
        load_summary_pairs(spec, field)


def _pick_field(named: str | None, candidates: tuple[str, ...], columns: list[str], field: str, source: str) -> str:
    if named is not None:
        if named not in columns:
            raise UserError(f"{field}: {source!r} has no field {named!r}; fields: {', '.join(columns)}")
        return named
    found = next((c for c in candidates if c in columns), None)
    if found is None:
        raise UserError(f"{field}: none of {', '.join(candidates)} in {source!r}; name the field "
                        f"(fields: {', '.join(columns)})")
    return found


def _records(spec: DatasetSpec, field: str) -> Iterable[dict[str, Any]]:
    import datasets

    datasets.logging.set_verbosity_error()
    try:
        if spec.source.startswith("modelscope:"):
            return _modelscope_records(spec, field)
        if is_local(spec.source):
            return _local_records(Path(spec.source).expanduser(), field)
        short = shortcuts().get(spec.source)
        if short:
            return datasets.load_dataset(
                short["path"], short.get("subset"), data_files=short.get("data_files"),
                split=spec.split if spec.split != "train" or "split" not in short else short["split"],
            )
        return datasets.load_dataset(spec.source, spec.subset, split=spec.split)
    except (FileNotFoundError, ConnectionError, OSError, ValueError) as exc:
        raise UserError(
            f"{field}.source: could not load dataset {spec.source!r} ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:160] if str(exc) else ''}); offline? download it elsewhere and "
            f"point {field}.source at a local .txt/.jsonl/.json/.parquet file"
        ) from None


def _local_records(path: Path, field: str) -> Iterable[dict[str, Any]]:
    """A local file's records; any failure of the reader (a malformed line, an empty file, a
    damaged Parquet footer) is a problem of that file: one line naming it."""
    import datasets

    builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(path.suffix, "text")
    try:
        with _silent_datasets():
            return datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as exc:  # datasets wraps parser errors in many types (DatasetGenerationError, …)
        cause = exc.__cause__ or exc
        reason = str(cause).splitlines()[0][:160] if str(cause) else type(cause).__name__
        raise UserError(f"{field}.source: {str(path)!r} could not be read as {builder} ({reason})") from None


@contextlib.contextmanager
def _silent_datasets() -> Iterator[None]:
    """`datasets` without progress bars or log lines (a damaged file's reader logs its failure
    too): a data file's error is then the only line on stderr. The caller's settings return."""
    import datasets

    bars_on, verbosity = datasets.is_progress_bar_enabled(), datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars_on:
            datasets.enable_progress_bars()


def _modelscope_records(spec: DatasetSpec, field: str) -> Iterable[dict[str, Any]]:
    from quantlab.models.sources import require_modelscope

    require_modelscope(f"{field}.source")
    from modelscope.msdatasets import MsDataset

    name = spec.source.removeprefix("modelscope:")
    return MsDataset.load(name, subset_name=spec.subset, split=spec.split)


def _render(records: Iterable[dict[str, Any]], spec: DatasetSpec, field: str, tokenizer: Any) -> Iterable[str]:
    short = shortcuts().get(spec.source, {})
    text_field = short.get("text_field", spec.text_field) if spec.text_field == "text" else spec.text_field
    for i, record in enumerate(records):
        if spec.format == "chat":
            yield render_chat(record, tokenizer, field, i)
            continue
        if text_field not in record:
            raise UserError(f"{field}.text_field: record {i} of {spec.source!r} has no field "
                            f"{text_field!r}; fields: {', '.join(record)}")
        value = record[text_field]
        if value is None:
            continue  # a record without text contributes nothing (not the string "None")
        if not isinstance(value, str):
            raise UserError(f"{field}.text_field: record {i} of {spec.source!r} has a {type(value).__name__} "
                            f"in {text_field!r}, not text")
        yield value


def chat_messages(record: dict[str, Any]) -> list[dict[str, str]] | None:
    """A record as chat messages: `messages`/`conversations` lists, or alpaca fields."""
    for key in ("messages", "conversations"):
        if isinstance(record.get(key), list):
            return [{"role": m.get("role", m.get("from")), "content": m.get("content", m.get("value"))}
                    for m in record[key]]
    if "instruction" in record:
        prompt = record["instruction"] + (f"\n\n{record['input']}" if record.get("input") else "")
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": record.get("output", "")}]
    return None


def render_chat(record: dict[str, Any], tokenizer: Any, field: str, index: int) -> str:
    messages = chat_messages(record)
    if messages is None:
        raise UserError(f"{field}.format: chat record {index} has neither 'messages' nor alpaca "
                        f"'instruction'/'output' fields; fields: {', '.join(record)}")
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise UserError(f"{field}.format: chat data needs a tokenizer with a chat template; this model has none")
    return tokenizer.apply_chat_template(messages, tokenize=False)
