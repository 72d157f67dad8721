"""The 12 Hz speech decoder run by rvqtts a few frames at a time, its state carried from one call to the next; a whole
utterance is decoded the same way, in pieces of PIECE_FRAMES frames. qwen-tts's decoder is causal throughout, so it
runs incrementally with nothing approximated, on qwen-tts's modules and weights in their order; rvqtts computes the
arithmetic itself to bound the working set and to run each convolution the way its shape wants.
docs/engine.md, "Streaming"."""

from __future__ import annotations

import copy

import numpy as np
import torch

# Frames a whole utterance is decoded by at a time (SpeechCodec.decode): the tensors of a piece stay a few MB
# (at 25 frames, 96 channels x 48,000 samples: 18 MB in float32), and pieces of 25 and 40 frames cost the same per
# frame, less than qwen-tts's one pass (docs/benchmarks.md "The speech decoder run by rvqtts").
PIECE_FRAMES = 25


class StreamingDecoder:
    """Codes in, waveform out, `push` after `push`: the samples of exactly the frames pushed so far."""

    def __init__(self, decoder: torch.nn.Module):
        """`decoder`: qwen-tts's 12 Hz speech decoder module (`speech_tokenizer.model.decoder`)."""
        self.decoder = decoder
        self.samples_per_frame = int(decoder.total_upsample)
        self.snakes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
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

    def decode(self, codes: torch.Tensor | np.ndarray, piece: int = PIECE_FRAMES) -> np.ndarray:
        """The waveform of a whole utterance's codes [frames, quantizers] after what was pushed before, pushed
        `piece` frames at a time."""
        pieces = [self.push(codes[start : start + piece]) for start in range(0, len(codes), piece)]
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)

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
            y = self._causal(module.conv1, self._snake(module.act1, x))
            return self._causal(module.conv2, self._snake(module.act2, y)).add_(x)
        if hasattr(module, "block"):  # a decoder block: its modules in order
            for part in module.block:
                x = self._run(part, x)
            return x
        if hasattr(module, "alpha") and hasattr(module, "beta"):  # SnakeBeta: pointwise in time
            return self._snake(module, x)
        raise ValueError(
            f"the streaming decoder does not know {type(module).__name__}: it may not be pointwise in "
            f"time, so it cannot run incrementally (decode offline, without --stream)"
        )

    def _snake(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """qwen-tts's SnakeBeta, x + (1 / (exp(beta) + eps)) * sin(x exp(alpha))^2, in one new buffer: the same
        operations in the same dtype, so the same bits (pow(s, 2) is s * s)."""
        factors = self.snakes.get(id(module))
        if factors is None:
            alpha = torch.exp(module.alpha.detach()[None, :, None])
            inverse = 1.0 / (torch.exp(module.beta.detach()[None, :, None]) + module.no_div_by_zero)
            factors = self.snakes[id(module)] = (alpha, inverse)
        y = x * factors[0]
        y.sin_()
        y.mul_(y)
        return y.mul_(factors[1]).add_(x)

    def _carried(self, module: torch.nn.Module, x: torch.Tensor, keep: int) -> torch.Tensor:
        """x with the module's last `keep` inputs in front (zeros before the first push), keeping the new
        last ones for the next push."""
        if keep == 0:
            return x
        previous = self.state.get(id(module))
        if previous is None:
            previous = x.new_zeros(*x.shape[:-1], keep)
        joined = torch.cat([previous, x], dim=-1)
        self.state[id(module)] = joined[..., -keep:].clone()  # a view would keep all of `joined` until the next push
        return joined

    def _causal(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A causal convolution (stride 1): the offline pass pads `padding` zeros on the left. Run by its shape
        (module docstring): as one product over the input's taps where the weight outweighs the input or the
        kernel is one step; tap by tap for a single output channel; else torch's convolution."""
        if module.stride != 1:
            raise ValueError("the streaming decoder handles stride-1 causal convolutions only")
        conv = module.conv
        joined = self._carried(module, x, module.padding)[0]  # [channels_in, steps + padding]
        taps, dilation, steps = conv.kernel_size[0], conv.dilation[0], x.shape[-1]
        if conv.groups == 1:
            shifted = [joined[:, k * dilation :][:, :steps] for k in range(taps)]  # each tap's inputs (views)
            if taps == 1 or conv.weight.numel() > joined.numel():
                columns = shifted[0] if taps == 1 else torch.stack(shifted, 1)  # [channels_in, taps, steps]
                weight = conv.weight.view(conv.out_channels, -1)
                return torch.addmm(conv.bias[:, None], weight, columns.reshape(-1, steps))[None]
            if conv.out_channels == 1:
                output = conv.bias[:, None].expand(1, steps).clone()
                for k in range(taps):
                    output.addmm_(conv.weight[:, :, k], shifted[k])
                return output[None]
        return conv(joined[None])

    def _transposed(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A transposed convolution with kernel k = m s and stride s (qwen-tts's are k = s and 2s): input t adds
        its k taps to samples t s .. t s + k - 1, so the s samples of input t are complete once the inputs
        up to t are in. One product gives every input's taps; each sample sums its m taps from the m last
        inputs (m - 1 carried from the previous push), and only the samples of the new inputs are emitted
        (the rest wait for the next input, as the offline pass trims them at the end)."""
        conv = module.conv
        kernel, stride = conv.kernel_size[0], conv.stride[0]
        if kernel % stride:
            raise ValueError(
                "the streaming decoder handles transposed convolutions of a kernel a multiple of the stride"
            )
        reach = kernel // stride
        joined = self._carried(module, x, reach - 1)[0]  # [channels_in, t + reach - 1]
        steps, outputs = x.shape[-1], conv.out_channels
        weight = conv.weight.view(conv.in_channels, -1)  # [channels_in, channels_out x k]
        if weight.numel() > joined.numel():  # few steps: the product reads the weight 2-5x faster this way round
            taps = (joined.T @ weight).T.contiguous()
        else:
            taps = weight.T @ joined
        # [channels_out, reach, stride, t + reach - 1]: time innermost, so the adds below run over long rows
        taps = taps.view(outputs, reach, stride, -1)
        samples = taps[:, 0, :, reach - 1 :] + conv.bias[:, None, None]  # [channels_out, stride, t]
        for back in range(1, reach):  # tap group `back` of the input `back` steps earlier
            samples.add_(taps[:, back, :, reach - 1 - back : reach - 1 - back + steps])
        return samples.transpose(1, 2).reshape(1, outputs, steps * stride)
