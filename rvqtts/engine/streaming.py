"""The 12 Hz speech decoder run a few frames at a time, its state carried from one call to the next.

qwen-tts decodes a whole utterance at once. Its decoder is causal throughout: causal convolutions
(zero left padding), transposed convolutions whose overlap only reaches forward, a transformer with
sliding-window attention of 72 frames, and pointwise layers. So it can run incrementally with nothing
approximated: each causal convolution keeps its last inputs (where the offline pass has zeros before
the start), each transposed convolution keeps the inputs its overlap needs and emits only the samples
that are complete, and the transformer keeps its KV cache (qwen-tts's own module, called with a Hugging
Face cache). The waveform equals the offline decode of the same codes up to float rounding (a test
bounds it); qwen-tts's offline decode is one pass up to 300 frames, and past that it re-decodes windows
with 25 frames of left context, which is itself an approximation of the one pass this class computes.

The weights are qwen-tts's; this file walks its modules in their own order, as the runners do for the
talker and the code predictor.
"""

from __future__ import annotations

import copy

import numpy as np
import torch


class StreamingDecoder:
    """Codes in, waveform out, `push` after `push`: the samples of exactly the frames pushed so far."""

    def __init__(self, speech_tokenizer: object):
        self.decoder = speech_tokenizer.model.decoder
        self.samples_per_frame = int(self.decoder.total_upsample)
        self.sample_rate = int(speech_tokenizer.model.get_output_sample_rate())
        self.reset()

    def reset(self) -> None:
        """Forget everything pushed: the next push starts an utterance."""
        from transformers import DynamicCache

        self.state: dict[int, torch.Tensor] = {}
        self.cache = DynamicCache(config=self.decoder.config)
        self.frames = 0

    def snapshot(self) -> tuple:
        """Everything pushed so far, to `restore` later (in this decoder or another of the same model):
        a cloned voice's reference is pushed once, not before every chunk. The carried inputs and the
        attention cache are copied compactly: a view would keep the whole last push's activations."""
        cache = copy.deepcopy(self.cache)
        for layer in getattr(cache, "layers", []):
            for name in ("keys", "values"):
                if isinstance(getattr(layer, name, None), torch.Tensor):
                    setattr(layer, name, getattr(layer, name).clone())
        return {key: value.clone() for key, value in self.state.items()}, cache, self.frames

    def restore(self, saved: tuple) -> None:
        """Continue from a `snapshot`, as if what it holds had just been pushed."""
        state, cache, self.frames = saved
        self.state, self.cache = dict(state), copy.deepcopy(cache)

    @torch.inference_mode()
    def push(self, codes: torch.Tensor | np.ndarray) -> np.ndarray:
        """The waveform (float32, samples_per_frame per frame) of the next frames' codes [n, quantizers]."""
        decoder = self.decoder
        codes = torch.as_tensor(codes, dtype=torch.long).to(decoder.pre_conv.conv.weight.device)
        count = codes.shape[0]
        hidden = decoder.quantizer.decode(codes.clamp(min=0).T[None])
        hidden = self._causal(decoder.pre_conv, hidden).transpose(1, 2)
        positions = torch.arange(self.frames, self.frames + count, device=hidden.device)
        hidden = decoder.pre_transformer(
            inputs_embeds=hidden, past_key_values=self.cache, use_cache=True, cache_position=positions
        ).last_hidden_state.permute(0, 2, 1)
        for blocks in decoder.upsample:
            for block in blocks:
                hidden = self._run(block, hidden)
        for block in decoder.decoder:
            hidden = self._run(block, hidden)
        self.frames += count
        return hidden.clamp(min=-1, max=1)[0, 0].float().cpu().numpy()

    def _run(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """One of the decoder's modules over the new time steps x [1, channels, t]: the stateful ones
        (recognised by their parts) with their state, pointwise ones (activations) as they are."""
        if hasattr(module, "right_pad"):  # a causal transposed convolution
            return self._transposed(module, x)
        if hasattr(module, "padding") and hasattr(module, "conv"):  # a causal convolution
            return self._causal(module, x)
        if hasattr(module, "dwconv"):  # a ConvNeXt block: causal depthwise convolution, then pointwise
            y = self._causal(module.dwconv, x).permute(0, 2, 1)
            y = module.pwconv2(module.act(module.pwconv1(module.norm(y))))
            return x + (module.gamma * y).permute(0, 2, 1)
        if hasattr(module, "conv1"):  # a residual unit
            y = self._causal(module.conv1, module.act1(x))
            return x + self._causal(module.conv2, module.act2(y))
        if hasattr(module, "block"):  # a decoder block: its modules in order
            for part in module.block:
                x = self._run(part, x)
            return x
        if hasattr(module, "alpha") and hasattr(module, "beta"):  # SnakeBeta: pointwise in time
            return module(x)
        raise ValueError(
            f"the streaming decoder does not know {type(module).__name__}: it may not be pointwise in "
            f"time, so it cannot run incrementally (decode offline, without --stream)"
        )

    def _carried(self, module: torch.nn.Module, x: torch.Tensor, keep: int) -> torch.Tensor:
        """x with the module's last `keep` inputs in front (zeros before the first push), keeping the new
        last ones for the next push."""
        if keep == 0:
            return x
        previous = self.state.get(id(module))
        if previous is None:
            previous = x.new_zeros(*x.shape[:-1], keep)
        joined = torch.cat([previous, x], dim=-1)
        self.state[id(module)] = joined[..., -keep:]
        return joined

    def _causal(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A causal convolution (stride 1): the offline pass pads `padding` zeros on the left."""
        if module.stride != 1:
            raise ValueError("the streaming decoder handles stride-1 causal convolutions only")
        return module.conv(self._carried(module, x, module.padding))

    def _transposed(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A transposed convolution with kernel k and stride s: an output sample depends on the inputs
        within ceil(k / s) of it, so `ceil(k / s) - 1` previous inputs come in front, and only the
        samples of the new inputs' strides are emitted (the rest are the previous call's, or wait for
        the next input, as the offline pass trims them at the end)."""
        kernel, stride = module.conv.kernel_size[0], module.conv.stride[0]
        keep = -(-kernel // stride) - 1
        y = module.conv(self._carried(module, x, keep))
        return y[..., keep * stride : (keep + x.shape[-1]) * stride]
