"""A failure on purpose, for batch tests here and in Ray workers (where a setup hook installs it)."""

from __future__ import annotations

BREAK = "Break."  # a batch line with this text fails
OVERFLOW = "Overflow."  # and one with this text meets NaN logits, as a float16 overflow would


def failing_synthesize(original):
    """Synthesizer.synthesize, except that the text BREAK raises RuntimeError("simulated failure") and
    OVERFLOW the NonFiniteError of a talker in float16."""

    def synthesize(self, text, **kwargs):
        import torch

        from rvqtts.engine.sampling import NonFiniteError

        if text == BREAK:
            raise RuntimeError("simulated failure")
        if text == OVERFLOW:
            raise NonFiniteError("talker", torch.float16)
        return original(self, text, **kwargs)

    return synthesize


def break_lines() -> None:
    """A Ray worker_process_setup_hook: this process's Synthesizer fails on BREAK."""
    from rvqtts.synthesis import Synthesizer

    Synthesizer.synthesize = failing_synthesize(Synthesizer.synthesize)
