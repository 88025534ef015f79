"""The run directory: every artifact of one recipe, and the manifest that makes runs resumable.

A stage is done when the manifest records its content key and every file it wrote is there,
unchanged (size and sha256; a damaged artifact reruns its stage, a damaged manifest reruns
every stage); a killed run therefore resumes at the first stage that is not done, and
changing one stage's parameters reruns only the stages whose keys depend on it. Files and directories are written
under a temporary name and renamed when complete, so a reader never sees half an artifact.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

from quantlab.errors import UserError

MANIFEST = "manifest.json"
RUNS_ROOT_ENV = "QUANTLAB_RUNS_ROOT"
ALLOW_OUTSIDE_ENV = "QUANTLAB_ALLOW_OUTSIDE"


def content_key(*parts: Any) -> str:
    """A stable hash of JSON-serialisable parts: the identity of a stage's inputs."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# The packages whose code decides what a stage writes (quantlab.kernels and the calibration
# presets live outside quantlab/ in a checkout, inside it once installed).
CODE_PACKAGES = ("quantlab", "quantlab.kernels", "quantlab.calib_data")


def code_fingerprint(dirs: tuple[Path, ...] | None = None) -> str:
    """A hash of quantlab's own source (`*.py` and `*.yaml` under CODE_PACKAGES, or `dirs`).

    Stage keys include it, so a run directory made by other code is redone rather than reused:
    recipe parameters alone cannot tell that a changed algorithm would write different
    weights. Installing another quantlab version, or editing a checkout, reruns every stage."""
    return _fingerprint(tuple(dirs) if dirs is not None else _package_dirs())


def _package_dirs() -> tuple[Path, ...]:
    out = []
    for name in CODE_PACKAGES:
        spec = importlib.util.find_spec(name)
        out += [Path(d) for d in (spec.submodule_search_locations or [])] if spec else []
    return tuple(out)


@functools.lru_cache(maxsize=8)
def _fingerprint(dirs: tuple[Path, ...]) -> str:
    files = sorted({f.resolve() for d in dirs for pattern in ("*.py", "*.yaml")
                    for f in Path(d).rglob(pattern) if "__pycache__" not in f.parts})
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def file_sha256(path: Path) -> str:
    """The file's sha256, read once per version of the file in this process: `quantlab eval`
    verifies the quantized form before pinning it and the run verifies it again (a 72B form
    takes about a minute to read). A version is its inode, size and change times."""
    st = path.stat()
    return _sha256(str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@functools.lru_cache(maxsize=4096)
def _sha256(path: str, _inode: int, _size: int, _mtime_ns: int, _ctime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def atomic_path(target: Path) -> Iterator[Path]:
    """Yield a temporary sibling path; on success it replaces `target` (file or directory).

    A file replaces its target in one rename, so a kill at any moment leaves the old file or
    the new one (the manifest is never missing). A directory cannot be renamed over another:
    the old one is removed first, and a kill between the two leaves neither, which the
    manifest's record of the directory's files then reports as missing."""
    tmp = target.with_name(f".{target.name}.partial")
    _remove(tmp)
    try:
        yield tmp
    except BaseException:
        _remove(tmp)
        raise
    if tmp.is_dir() or target.is_dir():
        _remove(target)
    os.replace(tmp, target)


def write_text_atomic(target: Path, text: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(target) as tmp:
        tmp.write_text(text, encoding="utf-8")


def _is_partial(path: Path) -> bool:
    """A temporary name of `atomic_path`: what a killed write leaves, removed by the next one."""
    return path.name.startswith(".") and path.name.endswith(".partial")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def check_run_dir(path: Path) -> None:
    """Refuse a run directory whose use could destroy or mix with data the run did not create:
    a stage replaces its outputs wholesale (`quantized/`, `export/<format>/`), so the directory
    must be the run's own. Refused: a symbolic link (a run never writes through one into
    another directory), the filesystem root, the home directory, the current directory or one
    above it, anything that is not a directory, an existing non-empty directory that is not
    a quantlab run (no manifest.json), and a new directory outside `runs_root()`. Checked
    before anything is written (`plan.preflight`) and again when the run opens it."""
    text = str(path)
    if "\x00" in text:
        raise UserError("output.dir: contains a NUL character; give a plain path")
    if path.is_symlink():
        raise UserError(f"output.dir: {text!r} is a symbolic link; a run writes only into a directory of its "
                        "own, never through a link; give the real path or a new directory")
    absolute = path.expanduser().resolve()
    cwd, home = Path.cwd().resolve(), Path.home().resolve()
    if absolute == Path(absolute.anchor) or absolute == home or cwd.is_relative_to(absolute):
        what = ("the filesystem root" if absolute == Path(absolute.anchor) else "your home directory"
                if absolute == home else "the current directory or one above it")
        raise UserError(f"output.dir: {text!r} is {what}; stages replace whole subdirectories of the run "
                        "directory, so give a directory of its own, e.g. runs/<name>")
    if path.exists() and not path.is_dir():
        raise UserError(f"output.dir: {text!r} exists and is not a directory")
    existing = next(p for p in (absolute, *absolute.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"output.dir: {text!r} cannot be created: {str(existing)!r} is not a writable directory")
    is_run = (path / MANIFEST).is_file()
    if path.is_dir() and not is_run and any(not _is_partial(p) for p in path.iterdir()):
        raise UserError(f"output.dir: {text!r} already holds files and is not a quantlab run directory "
                        f"(no {MANIFEST}); give a new or empty directory")
    root = runs_root()
    if root is not None and not is_run and not absolute.is_relative_to(root):
        where = f"{RUNS_ROOT_ENV}={str(root)!r}" if os.environ.get(RUNS_ROOT_ENV) else f"the current directory {str(root)!r}"
        raise UserError(f"output.dir: {text!r} is outside the runs root, {where}; give a path under it, set "
                        f"{RUNS_ROOT_ENV}, or pass --allow-outside")


def runs_root() -> Path | None:
    """Where new run directories may be created: under $QUANTLAB_RUNS_ROOT, else under the
    current directory; None (anywhere) with `quantlab run --allow-outside`, which sets
    $QUANTLAB_ALLOW_OUTSIDE=1 so that the processes it starts inherit it. A recipe cannot
    widen this: a recipe from elsewhere naming `/etc/x` or `~/.ssh/x` is refused. An existing
    run directory (one with a manifest) is exempt: quantlab made it, with the flag if needed."""
    if os.environ.get(ALLOW_OUTSIDE_ENV) == "1":
        return None
    return Path(os.environ.get(RUNS_ROOT_ENV) or ".").expanduser().resolve()


class RunDir:
    def __init__(self, path: Path):
        self.path = path
        self.created: Path | None = None  # the outermost directory `open` created (None: it existed)
        # `damaged`: why manifest.json could not be used (then no stage counts as done, and the
        # file is rewritten as stages finish); None when it was absent or sound.
        self.manifest, self.damaged = load_manifest(path / MANIFEST)

    @classmethod
    def open(cls, path: Path) -> "RunDir":
        check_run_dir(path)
        created = next((p for p in reversed([path, *path.parents]) if not p.exists()), None)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"output.dir: cannot create {str(path)!r} ({exc.strerror or type(exc).__name__}); "
                            "give a writable directory") from None
        rd = cls(path)
        rd.created = created
        rd.manifest.setdefault("created", time.strftime("%Y-%m-%dT%H:%M:%S"))
        rd.manifest["versions"] = _versions()
        rd.save()  # first: a directory killed at any later moment is recognisably a run and resumes
        return rd

    def resolve(self, rel: str) -> Path:
        """A path inside the run directory; anything escaping it is refused."""
        target = (self.path / rel).resolve()
        if not target.is_relative_to(self.path.resolve()):
            raise UserError(f"output path {rel!r} escapes the run directory {str(self.path)!r}")
        return target

    def is_done(self, stage: str, key: str) -> bool:
        return self.verify(stage, key)[0]

    def verify(self, stage: str, key: str) -> tuple[bool, str | None]:
        """Whether `stage` is done with `key`, and, when the manifest records it with that key
        but its outputs are no longer what it wrote, why not: the first recorded file that is
        missing or differs ("quantized/model-00003-of-00031.safetensors changed since it was
        written (sha256 differs)").

        Every file recorded under the outputs (a directory output: each file in it) must exist
        with its recorded size and sha256: sizes first (cheap), then full hashes, i.e. every
        artifact is read once per resume (~0.2 s for SmolLM2's quantized form, about a minute
        for a 72B one). Files added to an output directory since are not looked at. An entry
        written before digests were recorded (no "files") is checked as that code checked it:
        its outputs exist, and file outputs match their recorded "sha256".

        Stages are checked in plan order, so a damaged upstream artifact reruns its stage before
        any stage that reads it runs. Keys hash upstream keys, not contents: the rerun stage
        records the same key, so its dependents are still done. That is right: they read the
        artifact before it was damaged, and their own outputs are verified on their own."""
        entry = self.manifest["stages"].get(stage)
        if not entry or entry["key"] != key:
            return False, None
        if "files" not in entry:  # recorded by older code
            for o in entry["outputs"]:
                target = self.resolve(o)
                if not target.exists():
                    return False, f"{o} is missing"
                if o in entry.get("sha256", {}) and target.is_file() and file_sha256(target) != entry["sha256"][o]:
                    return False, f"{o} changed since it was written (sha256 differs)"
            return True, None
        files = entry["files"]
        if missing := next((o for o in entry["outputs"] if not self.resolve(o).exists()), None):
            return False, f"{missing} is missing"
        for rel, want in files.items():
            target = self.resolve(rel)
            if not target.is_file():
                return False, f"{rel} is missing"
            if (size := target.stat().st_size) != want["size"]:
                return False, f"{rel} changed since it was written (size {size} bytes, was {want['size']})"
        for rel, want in files.items():
            if file_sha256(self.resolve(rel)) != want["sha256"]:
                return False, f"{rel} changed since it was written (sha256 differs)"
        return True, None

    def record(self, stage: str, key: str, outputs: list[str], seconds: float) -> None:
        """Record a finished stage: its key, and the size and sha256 of every file under each of
        its outputs ("files", keyed by path in the run directory, in sorted order). "sha256"
        keeps the digests of file outputs alone, as before (what `adopt_from_sibling` reads)."""
        files: dict[str, dict[str, Any]] = {}
        for o in outputs:
            target = self.resolve(o)
            found = sorted(f for f in target.rglob("*") if f.is_file()) if target.is_dir() else [target]
            for f in found:
                rel = f"{o.rstrip('/')}/{f.relative_to(target).as_posix()}" if target.is_dir() else o
                files[rel] = {"size": f.stat().st_size, "sha256": file_sha256(f)}
        self.manifest["stages"][stage] = {
            "key": key,
            "outputs": outputs,
            "seconds": round(seconds, 3),
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "sha256": {o: files[o]["sha256"] for o in outputs if o in files},
            "files": files,
        }
        self.save()

    def adopt_from_sibling(self, stage: str, key: str) -> Path | None:
        """Copy a finished stage with this key from a run directory beside this one, if one has
        it with intact outputs (the float baselines: a recipe compared with another on the same
        model and data does not evaluate the float model again). Returns the source, or None."""
        for other in sorted(p for p in self.path.parent.iterdir() if p.is_dir() and p != self.path):
            try:
                entry = load_manifest(other / MANIFEST)[0]["stages"].get(stage)
            except (OSError, ValueError, KeyError):
                continue
            files = entry.get("outputs", []) if entry and entry.get("key") == key else []
            if not files or any(not (other / o).is_file() or file_sha256(other / o) != entry["sha256"].get(o)
                                for o in files):
                continue
            for o in files:
                with atomic_path(self.resolve(o)) as tmp:
                    tmp.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(other / o, tmp)
            self.record(stage, key, files, entry.get("seconds", 0.0))
            self.manifest["stages"][stage]["reused_from"] = str(other)
            self.save()
            return other
        return None

    def forget(self, stage: str) -> None:
        self.manifest["stages"].pop(stage, None)

    def save(self) -> None:
        write_text_atomic(self.path / MANIFEST, json.dumps(self.manifest, indent=2) + "\n")

    @property
    def any_done(self) -> bool:
        return bool(self.manifest["stages"])


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "quantlab code": code_fingerprint()}
    for pkg in ("quantlab", "torch", "transformers", "safetensors", "datasets", "gguf"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def load_manifest(path: Path) -> tuple[dict[str, Any], str | None]:
    """The manifest at `path` and None; a fresh one when there is none. When it cannot be used
    (not JSON, not an object, "stages" not an object, an entry without its fields), a fresh one
    and what is wrong with it: no stage of it counts as done, never a traceback."""
    fresh: dict[str, Any] = {"stages": {}}
    if not path.is_file():
        return fresh, None
    try:
        manifest = json.loads(path.read_bytes())
    except (OSError, ValueError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return fresh, "not JSON"
    if not isinstance(manifest, dict):
        return fresh, "not a JSON object"
    stages = manifest.get("stages")
    if not isinstance(stages, dict):
        return fresh, "\"stages\" is missing or not an object"
    for name, entry in stages.items():
        if not _valid_entry(entry):
            return fresh, f"the entry of stage {name!r} lacks its key, outputs or digests"
    return manifest, None


def _valid_entry(entry: Any) -> bool:
    def is_map(value: Any, check) -> bool:
        return isinstance(value, dict) and all(isinstance(k, str) and check(v) for k, v in value.items())

    return (isinstance(entry, dict) and isinstance(entry.get("key"), str)
            and isinstance(entry.get("outputs"), list) and all(isinstance(o, str) for o in entry["outputs"])
            and is_map(entry.get("sha256", {}), lambda v: isinstance(v, str))
            and is_map(entry.get("files", {}), lambda v: isinstance(v, dict) and isinstance(v.get("sha256"), str)
                       and isinstance(v.get("size"), int)))
