"""Importing qwen-tts, quietly and on machines without a working torchaudio. `import qwen_tts` imports the 25 Hz
speech tokenizer, which imports `torchaudio.compliance.kaldi`; rvqtts runs only the 12 Hz models, which never call
torchaudio, but a torchaudio wheel that does not match the installed torch (a CUDA build beside a CPU torch) fails
at import. Then a placeholder whose functions raise a clear error is registered; a working torchaudio is left
alone."""

from __future__ import annotations

import contextlib
import importlib.machinery
import io
import os
import sys
import types
from types import ModuleType


def _torchaudio_placeholder_error(*args: object, **kwargs: object) -> None:
    raise RuntimeError(
        "torchaudio could not be imported, so rvqtts installed a placeholder for it. "
        "Only the 25 Hz Qwen3-TTS tokenizer needs torchaudio; rvqtts supports the 12 Hz models. "
        "Install a torchaudio build that matches your torch to use the 25 Hz path."
    )


def _install_torchaudio_placeholder() -> None:
    if "torchaudio" in sys.modules:
        return
    try:
        import torchaudio  # noqa: F401  (a working torchaudio is kept)

        return
    except Exception:  # any import failure: missing, or a build that does not match torch
        for name in [m for m in sys.modules if m.partition(".")[0] == "torchaudio"]:
            del sys.modules[name]
    root = types.ModuleType("torchaudio")
    compliance = types.ModuleType("torchaudio.compliance")
    kaldi = types.ModuleType("torchaudio.compliance.kaldi")
    kaldi.fbank = _torchaudio_placeholder_error  # type: ignore[attr-defined]
    root.compliance = compliance  # type: ignore[attr-defined]
    compliance.kaldi = kaldi  # type: ignore[attr-defined]
    for module in (root, compliance, kaldi):
        # transformers calls importlib.util.find_spec on optional packages; it needs a __spec__.
        module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)
        sys.modules[module.__name__] = module


def _import_quietly(name: str) -> ModuleType:
    """Import a module with file descriptors 1 and 2 silenced: qwen-tts prints a flash-attn banner at import and
    the `sox` package it imports runs `sox -h` through a shell; neither may reach stdout, where `rvqtts synth -o -`
    writes audio."""
    if name in sys.modules:
        return sys.modules[name]
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            os.dup2(devnull, fd)
        # Python-level streams too: they need not be file descriptors 1 and 2 (a test runner's buffers).
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            module = importlib.import_module(name)
    finally:
        for fd, kept in zip((1, 2), saved):
            os.dup2(kept, fd)
        for fd in (*saved, devnull):
            os.close(fd)
    return module


def qwen_tts() -> ModuleType:
    """Import and return the `qwen_tts` package, with the torchaudio guard in place."""
    _install_torchaudio_placeholder()
    return _import_quietly("qwen_tts")
