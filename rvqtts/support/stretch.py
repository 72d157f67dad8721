"""Speech at another speed with its pitch kept: WSOLA (waveform-similarity overlap-add, Verhelst and Roelands 1993).
Each 40 ms output frame is an input segment taken near where the speed puts it, shifted by up to 10 ms to the place
whose waveform best continues the previous frame's (their cross-correlation), and overlap-added under a Hann window at
half a frame's hop. It runs as a stream with its state carried: a frame is made once the input it reads has come, so
pieces pushed one by one give the very samples the whole gives at once (a streamed response's pieces join with no
seam). docs/usage.md, "Speed"."""

from __future__ import annotations

import numpy as np

MIN_SPEED, MAX_SPEED = 0.25, 4.0  # OpenAI's range for `speed`
FRAME_SECONDS = 0.040
SEARCH_SECONDS = 0.010  # how far a frame may move from where the speed puts it


def check_speed(speed: float) -> float:
    """`speed` if it is a finite number in MIN_SPEED..MAX_SPEED, else ValueError saying so."""
    if not MIN_SPEED <= speed <= MAX_SPEED:  # NaN fails too
        raise ValueError(f"speed must be from {MIN_SPEED} to {MAX_SPEED} (1 = the model's pace), got {speed}")
    return speed


class TimeStretch:
    """Mono float32 samples at `speed` times their pace (2: half as long), pushed piece by piece; `finish` gives the
    rest. The output holds round(input / speed) samples. Frame k reads the input from about k hop speed - hop and
    covers the output from (k - 1) hop, so the output's every sample lies under two frames' windows (the input
    before the first sample is silence)."""

    def __init__(self, speed: float, sample_rate: int):
        self.speed = check_speed(speed)
        self.hop = round(FRAME_SECONDS * sample_rate / 2)
        self.width = 2 * self.hop
        self.search = round(SEARCH_SECONDS * sample_rate)
        self.window = np.hanning(self.width + 1)[:-1].astype(np.float32)  # periodic: halves overlapped sum to 1
        self.start = -self.hop - self.search  # the input position of `self.input[0]`
        self.input = np.zeros(self.hop + self.search, dtype=np.float32)
        self.pushed = 0  # input samples pushed
        self.frames = 0  # frames made
        self.taken = 0  # where the last frame was read from
        self.tail = np.zeros(self.hop, dtype=np.float32)  # the last frame's second half, awaiting the next frame
        self.emitted = 0  # output samples given

    def push(self, samples: np.ndarray) -> np.ndarray:
        """The output samples that `samples` (the next input) complete."""
        self.input = np.concatenate([self.input, np.asarray(samples, dtype=np.float32)])
        self.pushed += len(samples)
        return self._frames(until=None)

    def finish(self) -> np.ndarray:
        """The rest of the output: the input's end followed by silence, cut at round(input / speed) samples."""
        return self._frames(until=round(self.pushed / self.speed))

    def _frames(self, until: int | None) -> np.ndarray:
        """The frames whose input has come (`until` None), or (at the end) those that complete the output's first
        `until` samples, the input padded with silence; the output samples they complete."""
        out = []
        while until is None or self.emitted < until:
            nominal = round(self.frames * self.hop * self.speed) - self.hop
            lowest, highest = (nominal - self.search, nominal + self.search) if self.frames else (nominal, nominal)
            template = self.taken + self.hop  # where the last frame's waveform goes on
            needed = max(highest, template) + self.width - self.start
            if needed > len(self.input):
                if until is None:
                    break
                self.input = np.concatenate([self.input, np.zeros(needed - len(self.input), np.float32)])
            region = self.input[lowest - self.start : highest + self.width - self.start]
            shift = 0
            if self.frames:
                natural = self.input[template - self.start : template + self.width - self.start]
                shift = int(np.argmax(np.correlate(region, natural, mode="valid")))
            frame = region[shift : shift + self.width] * self.window
            if self.frames:  # output (k - 1) hop .. k hop, complete now (frame 0's first half lies before 0)
                piece = self.tail + frame[: self.hop]
                piece = piece if until is None else piece[: until - self.emitted]
                out.append(piece)
                self.emitted += len(piece)
            self.tail = frame[self.hop :]
            self.taken, self.frames = lowest + shift, self.frames + 1
            forget = min(self.taken + self.hop, round(self.frames * self.hop * self.speed) - self.hop - self.search)
            self.input, self.start = self.input[forget - self.start :], forget  # no later frame reads before it
        return np.concatenate(out) if out else np.zeros(0, dtype=np.float32)


def time_stretched(samples: np.ndarray, speed: float, sample_rate: int) -> np.ndarray:
    """A whole waveform at `speed` (1: itself)."""
    if speed == 1.0:
        return samples
    stretch = TimeStretch(speed, sample_rate)
    return np.concatenate([stretch.push(samples), stretch.finish()])
