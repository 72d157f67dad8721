"""Files written whole or not at all: a reader (or a user after Ctrl-C) never sees half a file."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomically(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` through a temporary file and a rename: readers never see a partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
        os.chmod(partial, 0o666 & ~current_umask())  # mkstemp makes 0600; give the file ordinary permissions
        os.replace(partial, path)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise


def write_json(path: str | os.PathLike, document: object) -> None:
    """Write a JSON document (indented, UTF-8, newline-terminated) atomically."""
    write_atomically(path, (json.dumps(document, indent=1, ensure_ascii=False) + "\n").encode())


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
