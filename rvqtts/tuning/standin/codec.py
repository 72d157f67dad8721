"""A residual VQ codec of the Qwen3-TTS shape: 12.5 Hz frames, 16 codebooks of k-means over log-mel frames,
trained in seconds (docs/standin.md, step 2). The spectra are numpy's and torch's own, with librosa.stft's bits,
as librosa's own STFT compiles numba functions on first use.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

SAMPLE_RATE = 24000
HOP = 480  # 20 ms
HOPS_PER_FRAME = 4  # 80 ms frames: 1920 samples, 12.5 Hz
N_FFT = 1024
MELS = 32
LEVELS = 16


def _mel_basis() -> np.ndarray:
    import librosa

    return librosa.filters.mel(sr=SAMPLE_RATE, n_fft=N_FFT, n_mels=MELS, fmin=40.0, fmax=8000.0)


def _hann() -> np.ndarray:
    """The periodic Hann window of N_FFT points, float64."""
    import scipy.signal

    return scipy.signal.get_window("hann", N_FFT, fftbins=True)


def power_spectrum(audio: np.ndarray) -> np.ndarray:
    """|STFT|^2 [N_FFT // 2 + 1, hops] of float32 audio, each hop's frame centred on it (zero padding):
    librosa.stft(audio, n_fft=N_FFT, hop_length=HOP, center=True)'s bits, squared."""
    padded = np.pad(audio, N_FFT // 2)
    frames = np.lib.stride_tricks.sliding_window_view(padded, N_FFT)[::HOP].T  # [N_FFT, hops]
    spectrum = np.fft.rfft(_hann()[:, None] * frames, axis=0).astype(np.complex64)
    return np.abs(spectrum) ** 2


def frame_features(audio: np.ndarray) -> np.ndarray:
    """Log-mel features [frames, HOPS_PER_FRAME * MELS] of 24 kHz audio (a partial last frame is dropped)."""
    mel = np.log(_mel_basis() @ power_spectrum(audio) + 1e-6).T  # [hops, MELS]
    frames = mel.shape[0] // HOPS_PER_FRAME
    return mel[: frames * HOPS_PER_FRAME].reshape(frames, HOPS_PER_FRAME * MELS).astype(np.float32)


def griffin_lim(magnitude: np.ndarray, iterations: int = 32, momentum: float = 0.99, seed: int = 0) -> np.ndarray:
    """Audio whose STFT magnitude approximates `magnitude` [N_FFT // 2 + 1, hops]: fast Griffin-Lim (Perraudin,
    Balazs and Sondergaard 2013), from random phases (seeded)."""
    window = torch.from_numpy(_hann())
    target = torch.from_numpy(magnitude).double()
    length = HOP * (target.shape[1] - 1)

    def stft(audio: torch.Tensor) -> torch.Tensor:
        return torch.stft(audio, N_FFT, HOP, window=window, center=True, pad_mode="constant", return_complex=True)

    def istft(spectrum: torch.Tensor) -> torch.Tensor:
        return torch.istft(spectrum, N_FFT, HOP, window=window, center=True, length=length)

    generator = torch.Generator().manual_seed(seed)
    phases = torch.polar(torch.ones_like(target), 2 * torch.pi * torch.rand(target.shape, generator=generator).double())
    previous = torch.zeros_like(phases)
    for _ in range(iterations):
        rebuilt = stft(istft(target * phases))
        phases = rebuilt - momentum / (1 + momentum) * previous
        phases = phases / (phases.abs() + 1e-16)
        previous = rebuilt
    return istft(target * phases).float().numpy()


def _nearest(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    distances = (x * x).sum(1, keepdim=True) - 2 * x @ centroids.T + (centroids * centroids).sum(1)[None]
    return distances.argmin(1)


def kmeans(x: torch.Tensor, entries: int, iterations: int, generator: torch.Generator) -> torch.Tensor:
    """Lloyd's k-means from random distinct points; an emptied cluster restarts at the worst-fit point."""
    centroids = x[torch.randperm(x.shape[0], generator=generator)[:entries]].clone()
    for _ in range(iterations):
        assign = _nearest(x, centroids)
        sums = torch.zeros_like(centroids).index_add_(0, assign, x)
        counts = torch.bincount(assign, minlength=entries).to(x.dtype)
        empty = counts == 0
        centroids = torch.where(empty[:, None], centroids, sums / counts.clamp(min=1)[:, None])
        if empty.any():
            error = ((x - centroids[assign]) ** 2).sum(1)
            worst = torch.topk(error, int(empty.sum())).indices
            centroids[empty] = x[worst]
    return centroids


@dataclass
class ResidualCodec:
    """Feature normalisation and LEVELS codebooks of `entries` vectors each."""

    mean: np.ndarray
    std: np.ndarray
    codebooks: np.ndarray  # [LEVELS, entries, dim]

    @classmethod
    def fit(
        cls, features: np.ndarray, entries: int, iterations: int = 12, seed: int = 0, device: str = "cpu"
    ) -> "ResidualCodec":
        mean, std = features.mean(0), features.std(0) + 1e-3
        residual = torch.from_numpy((features - mean) / std).to(device)
        generator = torch.Generator().manual_seed(seed)
        books = []
        for _ in range(LEVELS):
            book = kmeans(residual, entries, iterations, generator)
            residual = residual - book[_nearest(residual, book)]
            books.append(book.cpu().numpy())
        return cls(mean, std, np.stack(books))

    def encode(self, features: np.ndarray) -> np.ndarray:
        """Codes [frames, LEVELS] (int64), greedily level by level."""
        residual = torch.from_numpy((features - self.mean) / self.std)
        codes = []
        for book in torch.from_numpy(self.codebooks):
            index = _nearest(residual, book)
            residual = residual - book[index]
            codes.append(index)
        return torch.stack(codes, 1).numpy().astype(np.int64)

    def decode(self, codes: np.ndarray) -> np.ndarray:
        """Features back from codes: the sum of the chosen entries, un-normalised."""
        total = sum(self.codebooks[level][codes[:, level]] for level in range(codes.shape[1]))
        return total * self.std + self.mean

    def to_audio(self, codes: np.ndarray) -> np.ndarray:
        """Audio to listen to: the decoded mel spectrum to a power spectrum (least squares, clipped at 0),
        then Griffin-Lim."""
        mel = np.exp(self.decode(codes).reshape(-1, MELS).T)  # [MELS, hops]
        power = np.maximum(np.linalg.pinv(_mel_basis()) @ mel, 0.0)
        return griffin_lim(np.sqrt(power))

    def save(self, path: Path) -> None:
        """The codebooks are stored in float16 (half the size; decoding is for listening only)."""
        np.savez(path, mean=self.mean, std=self.std, codebooks=self.codebooks.astype(np.float16))
