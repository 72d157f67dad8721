"""Sampling codes exactly as qwen-tts does, with noise that is a pure function of where the code sits: the target is
softmax(top-p(top-k(logits / temperature))) with the semantics of Hugging Face's warpers, and a draw is the
Gumbel-max argmax(warped logits + G), G keyed by (seed, utterance, frame, position, token). Plain and speculative
decoding consume the same noise for the same code, so they emit the same codes on any backend and in any call
shape. docs/engine.md, "Why it is exact" and "Same noise, same codes" (the key's layout, frozen by a test)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from rvqtts.engine.model import native

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
# A temperature below this draws greedily: sampling's limit as the temperature goes to 0, and the scaled logits stay
# finite in float32 (logits divided by 1e-300 overflow, and no code could be drawn from them).
MIN_TEMPERATURE = 1e-5
# Above this every code is about equally likely; far above it the temperature itself overflows float32 (1e308 is inf
# there, and -inf / inf is NaN), so it is refused.
MAX_TEMPERATURE = 1e4
NOISE_TAG = np.uint64(0x5256515454530001)  # "RVQTTS" and a layout version: changing the layout bumps it


@dataclass(frozen=True)
class SamplingConfig:
    """How one code is drawn. The defaults are qwen-tts's code-predictor (subtalker) defaults. A temperature below
    MIN_TEMPERATURE (0 included) draws greedily: `do_sample` is then False."""

    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    do_sample: bool = True

    def __post_init__(self) -> None:
        if self.do_sample and not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be 0 (greedy) or positive, at most {MAX_TEMPERATURE:g}, got {self.temperature}"
            )
        if self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "do_sample", False)
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 (off) or positive, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    def take(self, frames: torch.Tensor) -> SamplingConfig:
        """The sampling of rows that belong to `frames`: this, every row's (as RowSampling.take)."""
        return self


@dataclass(frozen=True)
class FrameSampling:
    """How an utterance's frames are drawn: c0 by the talker's config after its repetition penalty (C0Rules), c1..
    by the code predictor's (GenerationSettings.resolve makes it from what a user asked)."""

    talker: SamplingConfig
    predictor: SamplingConfig
    repetition_penalty: float

    def generate_kwargs(self, max_frames: int) -> dict:
        """qwen-tts keywords, for its stock loops. N generated talker tokens make N - 1 frames, hence the + 1."""
        return dict(
            do_sample=self.talker.do_sample,
            temperature=self.talker.temperature,
            top_k=self.talker.top_k,
            top_p=self.talker.top_p,
            repetition_penalty=self.repetition_penalty,
            subtalker_dosample=self.predictor.do_sample,
            subtalker_temperature=self.predictor.temperature,
            subtalker_top_k=self.predictor.top_k,
            subtalker_top_p=self.predictor.top_p,
            max_new_tokens=max_frames + 1,
        )

    def record(self) -> dict:
        """What `--stats-json` shows under "sampling"."""
        return {
            "talker": {**asdict(self.talker), "repetition_penalty": self.repetition_penalty},
            "predictor": asdict(self.predictor),
        }


class NonFiniteError(RuntimeError):
    """A model produced NaN or inf logits (an overflow in its dtype, or broken weights); the message says
    what to do. `rows`: the frames of the call whose logits were not finite (None: every one), which fail alone."""

    def __init__(self, model: str, dtype: torch.dtype, rows: list[int] | None = None):
        self.model, self.dtype = model, dtype  # to raise it again elsewhere (a cluster's driver)
        self.rows = rows
        name = str(dtype).removeprefix("torch.")
        advice = {
            "float16": "run again with --dtype bfloat16 or --dtype float32",
            "bfloat16": "run again with --dtype float32",
        }.get(name, "the checkpoint's weights may be broken")
        super().__init__(
            f"the {model} produced NaN or inf values in {name} (an overflow in this dtype, or broken "
            f"weights), so no code can be drawn from them: {advice}"
        )


def warp_logits(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Float32 logits over the last axis, scaled and filtered (-inf outside the kept set).

    Greedy decoding (do_sample=False) applies no warper, as in Hugging Face's generate().
    """
    scores = logits.float()
    if not config.do_sample:
        return scores
    if config.temperature != 1.0:
        scores = scores / config.temperature
    if 0 < config.top_k < scores.shape[-1]:
        kth = torch.topk(scores, config.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if config.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False, dim=-1)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - config.top_p)
        remove_sorted[..., -1:] = False
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores


def target_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """The exact distribution a draw follows: softmax of the warped logits (one-hot when greedy)."""
    scores = warp_logits(logits, config)
    if not config.do_sample:
        return torch.nn.functional.one_hot(scores.argmax(-1), scores.shape[-1]).float()
    return scores.softmax(dim=-1)


def entropy_bits(probs: torch.Tensor) -> torch.Tensor:
    """The entropy in bits of each distribution over the last dimension."""
    return -(probs * torch.log2(probs.clamp(min=1e-30))).sum(-1)


def draw(logits: torch.Tensor, noise: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Gumbel-max draw over the last axis: argmax(warped logits + noise); noise is ignored when greedy."""
    return draw_checked(logits, noise, config)[0]


def draw_checked(
    logits: torch.Tensor,
    noise: torch.Tensor,
    config: SamplingConfig | RowSampling,
    noise_rows: torch.Tensor | None = None,  # [rows]: row r draws with noise[noise_rows[r]] (None: noise[r])
) -> tuple[torch.Tensor, torch.Tensor]:
    """`draw`, and whether each row's logits were finite (bools shaped as the codes, on the device, read back with
    them): argmax takes a NaN or +inf where a row has one, so the drawn score alone tells. On a CPU where rvqtts's
    library runs, one native call draws the same codes (top-p off)."""
    if native_draws(logits, noise, config):
        rows = logits.reshape(-1, logits.shape[-1])
        configs = [config] * rows.shape[0] if isinstance(config, SamplingConfig) else config.row_configs()
        codes, finite = native.draw(
            rows,
            noise.reshape(-1, noise.shape[-1]),
            [c.temperature if c.do_sample else 0.0 for c in configs],
            [c.top_k for c in configs],
            noise_rows,
        )
        return codes.reshape(logits.shape[:-1]), finite.reshape(logits.shape[:-1])
    scores = noised_scores(logits, noise if noise_rows is None else noise[noise_rows], config)
    codes = scores.argmax(dim=-1)
    return codes, torch.isfinite(scores.gather(-1, codes.unsqueeze(-1))).squeeze(-1)


def native_draws(logits: torch.Tensor, noise: torch.Tensor, config: SamplingConfig | RowSampling) -> bool:
    """Whether rvqtts's library draws these rows: on a CPU where it runs, bfloat16 or float32 logits, top-p off."""
    configs = (config,) if isinstance(config, SamplingConfig) else config.configs
    return (
        logits.device.type == "cpu"
        and logits.dtype in (torch.bfloat16, torch.float32)
        and noise.dtype == torch.float32
        and all(c.top_p == 1.0 for c in configs)
        and native.level() is not None
    )


def noised_scores(logits: torch.Tensor, noise: torch.Tensor, config: SamplingConfig | RowSampling) -> torch.Tensor:
    """The scores a draw takes the argmax of: the warped logits plus the Gumbel noise (the logits alone when
    greedy), each row by its own config where rows are sampled differently."""
    if isinstance(config, RowSampling):
        return config.scores(logits, noise)
    scores = warp_logits(logits, config)
    return scores + noise if config.do_sample else scores


@dataclass(frozen=True, eq=False)
class RowSampling:
    """The sampling of a call whose rows belong to frames sampled differently (a server's requests sharing the
    calls): frame f draws by `configs[ids[f]]`. Every warper works row by row, so a row's scores are those its own
    config gives it alone."""

    configs: tuple[SamplingConfig, ...]
    ids: torch.Tensor  # [frames]: the index in `configs` of each frame's

    @classmethod
    def of(cls, configs: list[SamplingConfig], device: torch.device) -> SamplingConfig | RowSampling:
        """The frames' sampling: the one config where they share it (the calls then as for one utterance)."""
        distinct = list(dict.fromkeys(configs))
        if len(distinct) == 1:
            return distinct[0]
        ids = torch.tensor([distinct.index(config) for config in configs], device=device)
        return cls(tuple(distinct), ids)

    def take(self, frames: torch.Tensor) -> RowSampling:
        """The sampling of rows that belong to `frames` (a frame's index per row)."""
        return RowSampling(self.configs, self.ids[frames])

    def row_configs(self) -> list[SamplingConfig]:
        """Each row's config."""
        return [self.configs[i] for i in self.ids.tolist()]

    def scores(self, logits: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        mixed = noised_scores(logits, noise, self.configs[0])
        for index, config in enumerate(self.configs[1:], 1):
            mixed = torch.where((self.ids == index)[:, None], noised_scores(logits, noise, config), mixed)
        return mixed


class C0Rules:
    """The logits processors qwen-tts asks Hugging Face's `generate()` to apply to the talker's scores
    before the warpers: the repetition penalty over the utterance's c0 history (each id once, however
    often it recurs: a negative score is multiplied by the penalty, a positive one divided), end of
    speech barred for the first `min_frames` draws (qwen-tts's `min_new_tokens`), and the top 1,024 ids
    of the codec vocabulary (its control tokens) suppressed, except end of speech."""

    MIN_FRAMES = 2  # qwen-tts's min_new_tokens
    SUPPRESSED_TAIL = 1024

    def __init__(self, vocab_size: int, eos_id: int, repetition_penalty: float, device: torch.device):
        self.eos_id = eos_id
        self.penalty = repetition_penalty
        self.suppressed = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.suppressed[vocab_size - self.SUPPRESSED_TAIL :] = True
        self.suppressed[eos_id] = False

    def scores(self, logits: torch.Tensor, seen: torch.Tensor, draws: int) -> torch.Tensor:
        """Float32 scores [vocab] for the next c0 from the talker's logits, given which ids were drawn
        before (`seen`, a bool mask) and how many draws there were."""
        scores = logits.float()
        if self.penalty != 1.0:
            scores = torch.where(seen, torch.where(scores < 0, scores * self.penalty, scores / self.penalty), scores)
        scores = scores.masked_fill(self.suppressed, float("-inf"))
        if draws < self.MIN_FRAMES:
            scores[self.eos_id] = float("-inf")
        return scores


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _fold(key: np.ndarray, field: np.ndarray | int) -> np.ndarray:
    return _mix(key + np.asarray(field, dtype=np.int64).astype(np.uint64) + GOLDEN)


def residual_noise(seed: int, utterance: int, frame: int, code_groups: int, vocab: int) -> torch.Tensor:
    """The noise a frame's residual codes c1..c_{G-1} are drawn with ([G-1, vocab], float32, on the CPU)."""
    return torch.from_numpy(gumbel_noise(seed, utterance, frame, np.arange(1, code_groups), vocab))


def gumbel_noise(seed: int, utterance: int, frame: int, positions: np.ndarray | list[int], vocab: int) -> np.ndarray:
    """Gumbel noise of shape [len(positions), vocab], float32, for the given key fields.

    Positions are code indices within the frame (0 = c0, the talker's, 1 = c1 ... 15 = c15). Every field must be a
    non-negative integer below 2**63.
    """
    with np.errstate(over="ignore"):
        key = _fold(np.array([NOISE_TAG], dtype=np.uint64), seed)
        key = _fold(key, utterance)
        key = _fold(key, frame)
        keys = _fold(key, np.asarray(positions))[:, None]
        tokens = np.arange(1, vocab + 1, dtype=np.uint64)[None, :]
        bits = _mix(keys + tokens * GOLDEN)
    uniform = ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))
    return (-np.log(-np.log(uniform))).astype(np.float32)
