"""Files written whole or not at all: a reader (or a user after Ctrl-C) never sees half a file."""

from __future__ import annotations

import contextlib
import json
import os
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


def write_json(path: str | os.PathLike, document: object) -> None:
    """Write a JSON document (indented, UTF-8, newline-terminated) atomically."""
    write_atomically(path, (json.dumps(document, indent=1, ensure_ascii=False) + "\n").encode())


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
