"""Integrated loudness (ITU-R BS.1770-4, in LUFS) of mono audio measured block by block, so that a chapter of any
length is measured in flat memory: K-weighting (a high shelf, then a high pass; pyloudnorm's coefficients' design),
the mean square of 100 ms steps, 400 ms gating blocks overlapping by 75 %, the absolute gate at -70 LUFS and the
relative gate 10 LU below the gated mean."""

from __future__ import annotations

import math

import numpy as np

ABSOLUTE_GATE = -70.0
RELATIVE_GATE = -10.0
STEP_SECONDS = 0.1  # a gating block is four steps
LOUDNESS_RANGE = (-50.0, -5.0)  # the targets a chapter may be normalized to, in LUFS


def _biquad(kind: str, gain_db: float, q: float, centre: float, rate: int) -> tuple[np.ndarray, np.ndarray]:
    """A second-order section's (b, a), normalized by a0: a high shelf or a high pass."""
    a_gain, w0 = 10 ** (gain_db / 40.0), 2.0 * math.pi * centre / rate
    alpha, cos = math.sin(w0) / (2.0 * q), math.cos(w0)
    if kind == "high_shelf":
        root = 2.0 * math.sqrt(a_gain) * alpha
        b = [
            a_gain * ((a_gain + 1) + (a_gain - 1) * cos + root),
            -2 * a_gain * ((a_gain - 1) + (a_gain + 1) * cos),
            a_gain * ((a_gain + 1) + (a_gain - 1) * cos - root),
        ]
        a = [(a_gain + 1) - (a_gain - 1) * cos + root, 2 * ((a_gain - 1) - (a_gain + 1) * cos)]
        a.append((a_gain + 1) - (a_gain - 1) * cos - root)
    else:
        b = [(1 + cos) / 2, -(1 + cos), (1 + cos) / 2]
        a = [1 + alpha, -2 * cos, 1 - alpha]
    return np.array(b) / a[0], np.array(a) / a[0]


class LoudnessMeter:
    """Feed it a signal's blocks in order (`push`), then read its integrated loudness (`integrated`)."""

    def __init__(self, rate: int):
        self.filters = [
            _biquad("high_shelf", 4.0, 1 / math.sqrt(2), 1500.0, rate),
            _biquad("high_pass", 0.0, 0.5, 38.0, rate),
        ]
        self.states = [np.zeros(2) for _ in self.filters]
        self.step = int(round(STEP_SECONDS * rate))
        self.pending = np.zeros(0)
        self.steps: list[float] = []  # each 100 ms step's mean square, K-weighted

    def push(self, block: np.ndarray) -> None:
        from scipy.signal import lfilter

        weighted = np.asarray(block, dtype=np.float64)
        for index, (b, a) in enumerate(self.filters):
            weighted, self.states[index] = lfilter(b, a, weighted, zi=self.states[index])
        joined = np.concatenate([self.pending, weighted])
        whole = joined.size // self.step * self.step
        self.steps.extend(np.mean(joined[:whole].reshape(-1, self.step) ** 2, axis=1).tolist())
        self.pending = joined[whole:]

    def integrated(self) -> float:
        """The integrated loudness in LUFS (-inf for silence or audio shorter than one gating block)."""
        steps = np.array(self.steps)
        if steps.size < 4:
            return -math.inf
        blocks = (steps[:-3] + steps[1:-2] + steps[2:-1] + steps[3:]) / 4.0  # 400 ms, every 100 ms

        def loudness(energies: np.ndarray) -> float:
            return -0.691 + 10.0 * math.log10(energies.mean()) if energies.size and energies.mean() > 0 else -math.inf

        above = blocks[-0.691 + 10.0 * np.log10(np.maximum(blocks, 1e-30)) > ABSOLUTE_GATE]
        if not above.size:
            return -math.inf
        relative = loudness(above) + RELATIVE_GATE
        return loudness(above[-0.691 + 10.0 * np.log10(above) > relative])


def check_loudness_target(target: float) -> None:
    low, high = LOUDNESS_RANGE
    if not low <= target <= high:
        raise ValueError(f"a loudness target is {low:g} to {high:g} LUFS (audiobooks: -18 to -23), got {target:g}")
