"""rvqtts: fast, exact Qwen3-TTS 12 Hz synthesis (docs/architecture.md shows the layers).

The public API, importable from here: `Synthesizer` (load a checkpoint, synthesize, stream, batches),
`GenerationSettings`, `Line`, `StreamPacing` and `Synthesis`. They load on first use, so that importing rvqtts (and
the command line's quick answers) does not pay for torch and qwen-tts.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rvqtts.qwen.codec import StreamPacing
    from rvqtts.synthesis.settings import GenerationSettings, Line, Synthesis
    from rvqtts.synthesis.synthesizer import AudioStream, Synthesizer

__all__ = ["AudioStream", "GenerationSettings", "Line", "StreamPacing", "Synthesis", "Synthesizer"]
_HOMES = {
    "AudioStream": "rvqtts.synthesis.synthesizer",
    "Synthesizer": "rvqtts.synthesis.synthesizer",
    "GenerationSettings": "rvqtts.synthesis.settings",
    "Line": "rvqtts.synthesis.settings",
    "StreamPacing": "rvqtts.qwen.codec",
    "Synthesis": "rvqtts.synthesis.settings",
}


def __getattr__(name: str) -> object:
    if name in _HOMES:
        return getattr(import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'rvqtts' has no attribute {name!r}")
