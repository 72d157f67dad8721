"""The talker's prompt, built by qwen-tts's own prompt code: read from the inputs of the talker's first forward call
through a forward pre-hook (no method is replaced), the call stopped there (docs/engine.md, "The prompt")."""

from __future__ import annotations

from typing import Callable

import torch

from rvqtts.engine.model.talker import Prompt
from rvqtts.qwen.cloning import ClonedVoice


class _Captured(Exception):
    def __init__(self, inputs: dict):
        super().__init__("prompt captured")
        self.inputs = inputs


def capture_prompt(talker: torch.nn.Module, generate: Callable[[], object]) -> Prompt:
    """Run `generate` (a qwen-tts generation call for one utterance) up to the talker's first forward
    call and return the prompt that call received."""

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        raise _Captured(kwargs)

    handle = talker.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        generate()
    except _Captured as captured:
        inputs = captured.inputs
    else:
        raise RuntimeError("qwen-tts finished without calling the talker: no prompt to capture")
    finally:
        handle.remove()
    embeds, mask = inputs["inputs_embeds"], inputs.get("attention_mask")
    if embeds.shape[0] != 1 or (mask is not None and not bool(mask.all())):
        raise RuntimeError("expected the prompt of one unpadded utterance")
    return Prompt(embeds=embeds[0], trailing=inputs["trailing_text_hidden"][0], pad=inputs["tts_pad_embed"].view(-1))


def qwen_generate(
    synth, text: str, speaker: str | None, language: str, instruct: str | None, clone: ClonedVoice | None, **options
):
    """qwen-tts's own generation call for this model's kind (the voice checked by the caller): `synth`'s
    prompt builder (Synthesizer.prompt), and stock qwen-tts for the benchmarks (rvqtts.bench.stock)."""
    if synth.kind == "voice_design":
        return synth.tts.generate_voice_design(text=text, instruct=instruct, language=language, **options)
    if synth.kind == "base":
        return synth.tts.generate_voice_clone(
            text=text, language=language, voice_clone_prompt=[clone.prompt_item(synth.talker.device)], **options
        )
    return synth.tts.generate_custom_voice(
        text=text,
        speaker=speaker,
        language=language,
        instruct=instruct if synth.supports_instruct else None,
        **options,
    )
