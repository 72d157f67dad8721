"""Files written whole or not at all: a reader (or a user after Ctrl-C) never sees half a file. And the user's cache
folder, which a run does without (warned once) where it cannot be written."""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside `path` to write; renamed to `path` when the block ends, removed if it fails:
    readers never see a partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(handle)
    try:
        yield Path(partial)
        os.chmod(partial, 0o666 & ~current_umask())  # mkstemp makes 0600; give the file ordinary permissions
        os.replace(partial, path)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise


def write_atomically(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` through a temporary file and a rename."""
    with atomic_path(path) as partial:
        partial.write_bytes(data)


def json_bytes(document: object) -> bytes:
    """A JSON document as rvqtts writes its files: indented, UTF-8, newline-terminated."""
    return (json.dumps(document, indent=1, ensure_ascii=False) + "\n").encode()


def write_json(path: str | os.PathLike, document: object) -> None:
    """Write a JSON document atomically."""
    write_atomically(path, json_bytes(document))


def read_records(path: Path) -> dict:
    """A cache file's JSON object, or an empty one where the file is missing or damaged (measured anew)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_json(path: Path, what: str, error: type[Exception]) -> object:
    """Parse a JSON file; a missing, unreadable or malformed file raises `error` naming `what` and the path."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as fault:
        raise error(f"cannot read {what} {path}: {fault}") from fault
    except json.JSONDecodeError as fault:
        raise error(f"{what} {path} is not valid JSON: {fault}") from fault


def cache_dir() -> Path:
    """rvqtts's per-user folder for measured choices and exported packages ($RVQTTS_CACHE, else the
    platform's cache folder: $XDG_CACHE_HOME or ~/.cache, then rvqtts)."""
    if os.environ.get("RVQTTS_CACHE"):
        return Path(os.environ["RVQTTS_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "rvqtts"


# The cache's files this process could not write (a read-only file system, a file in the way), as it would have
# written them: what it measured is kept here for its own reads, and measured again by the next process.
_UNSAVED: dict[Path, bytes] = {}
_warned = False


def warn_unwritable(folder: Path, error: OSError) -> None:
    """Say on stderr, once per process, that the cache cannot be written, why, and what to do: an unwritable cache
    only costs the next run its measurements, so it warns instead of failing."""
    global _warned
    if not _warned:
        _warned = True
        print(
            f"rvqtts: warning: the cache folder {folder} cannot be written ({error.strerror or error}): what this run "
            "measures is kept for this run only, and measured again by the next; point RVQTTS_CACHE at a writable "
            "folder",
            file=sys.stderr,
        )


def read_cache(path: Path) -> dict:
    """A cache file's JSON object as `read_records` reads it, or as this process last wrote it where the cache
    could not keep it."""
    kept = _UNSAVED.get(path)
    return read_records(path) if kept is None else json.loads(kept)


def unsaved(path: Path) -> bool:
    """Whether this process keeps the cache file `path` in memory, the cache having refused it."""
    return path in _UNSAVED


def write_cache(path: Path, document: dict) -> None:
    """Write a cache file atomically; where the cache cannot be written, keep the document for this process's
    reads instead (`read_cache`) and warn once: a run never fails for want of a cache."""
    data = json_bytes(document)
    try:
        write_atomically(path, data)
    except OSError as error:
        warn_unwritable(path.parent, error)
        _UNSAVED[path] = data
    else:
        _UNSAVED.pop(path, None)


def cache_file(folder: str, name: str) -> Path:
    """Where the cache keeps `name`, a file written whole by name (a native build, a Core ML package), in its
    `folder`: there when it is there already or can be written there; else in a folder of this process's own
    (warned once), so that a run without a writable cache still builds what it needs."""
    path = cache_dir() / folder / name
    if path.exists():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path.parent).close()
    except OSError as error:
        warn_unwritable(path.parent, error)
        return process_cache() / folder / name
    return path


@functools.cache
def process_cache() -> Path:
    """A temporary folder for the cache's files where the cache cannot be written, removed as the process exits."""
    folder = Path(tempfile.mkdtemp(prefix="rvqtts-cache-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


class OutputPathError(OSError):
    """An output path that cannot be written; the message names it and why."""


def check_writable(path: str | os.PathLike, folder: bool = False) -> None:
    """Raise OutputPathError unless a file can be written at `path` (or into it, a folder, with `folder`).

    Checked by doing it: missing folders are made, a probe file is created in the target folder, and
    both are removed again, so a run can stop before any model work and leave nothing behind."""
    made: list[Path] = []
    try:
        path = Path(path).expanduser()
        target = path if folder else path.parent
        if not folder and path.is_dir():
            raise OutputPathError(f"cannot write {path}: it is a folder; give a file name")
        missing, existing = [], target
        while not existing.exists() and existing != existing.parent:
            missing.append(existing)
            existing = existing.parent
        if not existing.is_dir():
            raise OutputPathError(f"cannot write {path}: {existing} is a file, not a folder")
        for part in reversed(missing):
            part.mkdir()
            made.append(part)
        handle, probe = tempfile.mkstemp(prefix=".rvqtts-probe.", dir=target)
        os.close(handle)
        os.unlink(probe)
    except OutputPathError:
        raise
    except RuntimeError as error:  # expanduser: no such user
        raise OutputPathError(f"cannot write {path}: {error}") from error
    except OSError as error:
        raise OutputPathError(
            f"cannot write {path}: {error.strerror or error}" + (f" ({error.filename})" if error.filename else "")
        ) from error
    finally:
        for part in reversed(made):
            with contextlib.suppress(OSError):
                part.rmdir()
