"""The engine as `rvqtts synth` makes it: one function from a checkpoint and the user's choices (device, dtypes,
weight format, tree policy, offsets, batch size) to a loaded model, every `auto` decided on this machine
(measured once and kept in the user's cache, rvqtts.support.measurements). The CLI, the server and Ray workers all load
through it, so `Synthesizer.load(model)` gives what `rvqtts synth --model model` gives."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from rvqtts.engine.model.devices import frame_maps, pick_device, pick_dtype, unvalidated_notice
from rvqtts.engine.model.kernels import choose_kernels, measured_choices
from rvqtts.engine.model.native import isa_cap, unavailable
from rvqtts.engine.model.quantize import WEIGHTS, WEIGHTS_CHOICES, check_weights
from rvqtts.engine.speculative.policy import choose_speculation
from rvqtts.engine.speculative.speculation import TreePolicy
from rvqtts.qwen.checkpoints import DTYPES, load_tts, model_config
from rvqtts.qwen.decoder_dtype import pick_decoder_dtype


@dataclass(frozen=True)
class EngineChoices:
    """What a user chooses about the engine, each as `rvqtts synth`'s option of the same name; `auto` is decided
    on this machine. ValueError, naming the option, for a value that is not one of the choices."""

    device: str = "auto"  # auto (cuda, then mps, then cpu), cpu, cuda[:N] or mps
    dtype: str = "auto"  # both loops' (auto: measured on a CPU; rvqtts.engine.model.devices)
    decoder_dtype: str = "auto"  # the speech decoder's (auto: measured on a CPU; rvqtts.qwen.decoder_dtype)
    weights: str = "native"  # or int8 (rvqtts.engine.model.quantize)
    spec: bool = True  # False: the plain inner loop (--no-spec)
    tree: str | os.PathLike = "auto"  # auto (chosen online), a node budget N or a tree file
    offsets: str | os.PathLike | None = None  # a draft offsets file (None: shipped ones matching the model)
    cuda_graphs: bool = True  # replay both loops' calls from CUDA graphs on CUDA devices
    batch_size: int | None = None  # lines spoken together (None: measured when a batch starts)
    tree_device: str | None = None  # "coreml": `tree` auto means the best size measured for Core ML

    def __post_init__(self) -> None:
        for name in ("dtype", "decoder_dtype"):
            if getattr(self, name) not in ("auto", *DTYPES):
                option = "--" + name.replace("_", "-")
                raise ValueError(f"unknown {option} {getattr(self, name)!r}: choose auto, {', '.join(DTYPES)}")
        if self.weights not in WEIGHTS:
            raise ValueError(f"unknown --weights {self.weights!r}: choose {WEIGHTS_CHOICES}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"the batch size must be at least 1 (or None: measured), got {self.batch_size}")


@dataclass
class LoadedModel:
    """A checkpoint loaded for the engine `EngineChoices` describe, every `auto` decided: qwen-tts's model in the
    loops' dtype, the tree policy (None: the plain inner loop) and the speech decoder's dtype."""

    tts: object  # qwen-tts's Qwen3TTSModel
    speculation: TreePolicy | None
    decoder_dtype: str


def load_model(
    model: str | os.PathLike, choices: EngineChoices, on_notice: Callable[[str], None] | None = None
) -> LoadedModel:
    """`model` (hub id or local folder) loaded as `choices` say. `on_notice` hears what the user should know: which
    dtypes `auto` chose and why, measurements starting, a device rvqtts has not validated, native kernels that
    cannot run here, the tree policy. Raises ModelLoadError, DeviceError, TreeFileError, OffsetsFileError or
    ValueError, each saying what to do; the model's config is checked before its weights load, and the kernels are
    measured before them too (not inside the first utterance's timings)."""

    def notice(message: str | None) -> None:
        if message and on_notice:
            on_notice(message)

    isa_cap()
    talker_config = model_config(model).talker_config  # the checkpoint's kind checked with it
    device = pick_device(choices.device)
    notice(unvalidated_notice(device))
    if device == "cpu" and (why := unavailable()):
        notice(f"rvqtts's native CPU kernels do not run here ({why}); torch's run instead, slower")
    rows = choices.batch_size or 1  # the lines a call carries, at which `auto` prices the loops' dtypes
    loops_dtype, reason = pick_dtype(choices.dtype, device, talker_config, choices.weights, notice, rows)
    notice(reason)
    if device == "cpu" and measured_choices():
        shapes = [shape for _, shape, _ in frame_maps(talker_config)]
        choose_kernels(shapes, getattr(torch, loops_dtype), choices.weights, notice)
    check_weights(choices.weights, torch.device(device))
    tts = load_tts(model, device, loops_dtype)
    decoder_dtype, reason = pick_decoder_dtype(
        choices.decoder_dtype, choices.dtype, loops_dtype, device, str(model), notice
    )
    notice(reason)
    speculation = None
    if choices.spec:
        speculation, reason = choose_speculation(
            tts.model.talker.code_predictor,
            choices.tree,
            choices.offsets,
            allow_plain=True,
            device_type=choices.tree_device,
            weights=choices.weights,
        )
        notice(reason)
    return LoadedModel(tts, speculation, decoder_dtype)
