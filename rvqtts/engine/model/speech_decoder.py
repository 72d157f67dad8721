"""The 12 Hz speech decoder run by rvqtts a few frames at a time, its state carried from one call to the next; a whole
utterance is decoded the same way, in pieces of PIECE_FRAMES frames, and several streams' pieces of one length in one
pass (`push_together`: a server's rows). qwen-tts's decoder is causal throughout, so it runs incrementally with
nothing approximated, on qwen-tts's modules and weights in their order; rvqtts computes the arithmetic itself to bound
the working set and to run each convolution the way its shape wants. docs/engine.md, "Streaming"."""

from __future__ import annotations

import copy
import weakref

import numpy as np
import torch

# Frames a whole utterance is decoded by at a time (SpeechCodec.decode): the tensors of a piece stay a few MB
# (at 25 frames, 96 channels x 48,000 samples: 18 MB in float32), and pieces of 25 and 40 frames cost the same per
# frame, less than qwen-tts's one pass (docs/benchmarks.md "The speech decoder run by rvqtts").
PIECE_FRAMES = 25

# Each SnakeBeta's (exp(alpha), 1 / (exp(beta) + eps)), computed once per module
_SNAKE_FACTORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class StreamingDecoder:
    """Codes in, waveform out, `push` after `push`: the samples of exactly the frames pushed so far."""

    def __init__(self, decoder: torch.nn.Module):
        """`decoder`: qwen-tts's 12 Hz speech decoder module (`speech_tokenizer.model.decoder`)."""
        self.decoder = decoder
        self.samples_per_frame = int(decoder.total_upsample)
        self.reset()

    def reset(self) -> None:
        """Forget everything pushed: the next push starts an utterance."""
        from transformers import DynamicCache

        self.state: dict[int, torch.Tensor] = {}  # by module: its last inputs [1, channels, steps]
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

    def push(self, codes: torch.Tensor | np.ndarray) -> np.ndarray:
        """The waveform (float32, samples_per_frame per frame) of the next frames' codes [n, quantizers]."""
        return push_together([self], torch.as_tensor(codes)[None])[0]

    def decode(self, codes: torch.Tensor | np.ndarray, piece: int = PIECE_FRAMES) -> np.ndarray:
        """The waveform of a whole utterance's codes [frames, quantizers] after what was pushed before, pushed
        `piece` frames at a time."""
        pieces = [self.push(codes[start : start + piece]) for start in range(0, len(codes), piece)]
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)


def push_together(streams: list[StreamingDecoder], codes: torch.Tensor | np.ndarray) -> list[np.ndarray]:
    """Each stream's waveform of its next frames' codes (codes [streams, n, quantizers]: the same n for all), in one
    pass over the decoder's weights: the rows of every product side by side, the attention of streams that have pushed
    the same frames in one call. A stream's samples are those of its own push up to float rounding (the products'
    shapes differ). The streams' states change only when the pass has ended: a pass that fails leaves them as they
    were, so that each can be pushed alone."""
    if not streams:
        return []
    if any(stream.decoder is not streams[0].decoder for stream in streams):
        raise ValueError("streams decoded together must share one speech decoder")
    return _Pass(streams).push(codes)


class _Pass:
    """One push of one or more streams: every module's inputs [streams, channels, steps], the streams' carried inputs
    stacked as each module is reached and their new ones kept aside until the pass ends."""

    def __init__(self, streams: list[StreamingDecoder]):
        self.streams = streams
        self.state: dict[int, torch.Tensor] = {}  # by module: the streams' new last inputs [streams, channels, steps]

    @torch.inference_mode()
    def push(self, codes: torch.Tensor | np.ndarray) -> list[np.ndarray]:
        decoder = self.streams[0].decoder
        codes = torch.as_tensor(codes, dtype=torch.long).to(decoder.pre_conv.conv.weight.device)
        count = codes.shape[1]
        hidden = decoder.quantizer.decode(codes.clamp(min=0).transpose(1, 2))
        hidden = self._causal(decoder.pre_conv, hidden).transpose(1, 2)
        hidden, caches = self._attend(decoder.pre_transformer, hidden)
        hidden = hidden.permute(0, 2, 1)
        for blocks in decoder.upsample:
            for block in blocks:
                hidden = self._run(block, hidden)
        for block in decoder.decoder:
            hidden = self._run(block, hidden)
        samples = hidden.clamp(min=-1, max=1)[:, 0].float().cpu().numpy()
        self.ended(caches, count)
        return list(samples)

    def ended(self, caches: list, frames: int) -> None:
        """The pass has ended: each stream keeps its new carried inputs, its attention cache and its frames."""
        many = len(self.streams) > 1
        for row, (stream, cache) in enumerate(
            zip(self.streams, caches)
        ):  # a stream's own copy: no stream keeps another's
            stream.state.update(
                {key: value[row : row + 1].clone() if many else value for key, value in self.state.items()}
            )
            stream.cache, stream.frames = cache, stream.frames + frames

    def _attend(self, transformer: torch.nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, list]:
        """The pre-transformer over hidden [streams, n, channels], with each stream's new attention cache: streams at
        the same frame in one call over their caches stacked, others one by one (their positions differ)."""
        streams, count = self.streams, hidden.shape[1]
        groups: dict[int, list[int]] = {}
        for row, stream in enumerate(streams):
            groups.setdefault(stream.frames, []).append(row)
        outputs: list = [None] * len(streams)
        caches: list = [None] * len(streams)
        for rows in groups.values():
            cache = _stacked_caches([streams[row].cache for row in rows])
            frames = streams[rows[0]].frames
            positions = torch.arange(frames, frames + count, device=hidden.device)
            attended = transformer(
                inputs_embeds=hidden[rows], past_key_values=cache, use_cache=True, cache_position=positions
            ).last_hidden_state
            for index, row in enumerate(rows):
                outputs[row] = attended[index : index + 1]
                caches[row] = cache if len(rows) == 1 else _cache_row(cache, index)
        return torch.cat(outputs), caches

    def _run(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """One of the decoder's modules over the new time steps x [streams, channels, t]: the stateful ones
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
            y = self._causal(module.conv1, _snake(module.act1, x))
            return self._causal(module.conv2, _snake(module.act2, y)).add_(x)
        if hasattr(module, "block"):  # a decoder block: its modules in order
            for part in module.block:
                x = self._run(part, x)
            return x
        if hasattr(module, "alpha") and hasattr(module, "beta"):  # SnakeBeta: pointwise in time
            return _snake(module, x)
        raise ValueError(
            f"the streaming decoder does not know {type(module).__name__}: it may not be pointwise in "
            f"time, so it cannot run incrementally (decode offline, without --stream)"
        )

    def _carried(self, module: torch.nn.Module, x: torch.Tensor, keep: int) -> torch.Tensor:
        """x with each stream's last `keep` inputs to the module in front (zeros before its first push), keeping the
        new last ones aside for the pass's end."""
        if keep == 0:
            return x
        key = id(module)
        previous = torch.cat(
            [stream.state[key] if key in stream.state else x.new_zeros(1, x.shape[1], keep) for stream in self.streams]
        )
        joined = torch.cat([previous, x], dim=-1)
        self.state[key] = joined[..., -keep:].clone()  # a view would keep all of `joined` until the pass ends
        return joined

    def _causal(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A causal convolution (stride 1): the offline pass pads `padding` zeros on the left. Run by its shape
        (module docstring): as one product over the input's taps, the streams' steps side by side, where the weight
        outweighs the input or the kernel is one step; tap by tap for a single output channel; else torch's
        convolution."""
        if module.stride != 1:
            raise ValueError("the streaming decoder handles stride-1 causal convolutions only")
        conv = module.conv
        joined = self._carried(module, x, module.padding)  # [streams, channels_in, steps + padding]
        taps, dilation, steps = conv.kernel_size[0], conv.dilation[0], x.shape[-1]
        streams = joined.shape[0]
        if conv.groups == 1:
            # each tap's inputs [channels_in, streams, steps] (views)
            shifted = [joined[:, :, k * dilation :][:, :, :steps].transpose(0, 1) for k in range(taps)]
            if taps == 1 or conv.weight.numel() > joined[0].numel():
                columns = shifted[0] if taps == 1 else torch.stack(shifted, 1)  # [channels_in, taps, streams, steps]
                weight = conv.weight.view(conv.out_channels, -1)
                product = torch.addmm(conv.bias[:, None], weight, columns.reshape(-1, streams * steps))
                return product.view(conv.out_channels, streams, steps).transpose(0, 1)
            if conv.out_channels == 1:
                output = conv.bias[:, None].expand(1, streams * steps).clone()
                for k in range(taps):
                    output.addmm_(conv.weight[:, :, k], shifted[k].reshape(-1, streams * steps))
                return output.view(1, streams, steps).transpose(0, 1)
        return conv(joined)

    def _transposed(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A transposed convolution with kernel k = m s and stride s (qwen-tts's are k = s and 2s): input t adds
        its k taps to samples t s .. t s + k - 1, so the s samples of input t are complete once the inputs
        up to t are in. One product gives every input's taps (the streams' side by side); each sample sums its m taps
        from the m last inputs (m - 1 carried from the previous push), and only the samples of the new inputs are
        emitted (the rest wait for the next input, as the offline pass trims them at the end)."""
        conv = module.conv
        kernel, stride = conv.kernel_size[0], conv.stride[0]
        if kernel % stride:
            raise ValueError(
                "the streaming decoder handles transposed convolutions of a kernel a multiple of the stride"
            )
        reach = kernel // stride
        joined = self._carried(module, x, reach - 1)  # [streams, channels_in, t + reach - 1]
        streams, steps, outputs = x.shape[0], x.shape[-1], conv.out_channels
        inputs = joined.transpose(0, 1).reshape(conv.in_channels, -1)  # [channels_in, streams x (t + reach - 1)]
        weight = conv.weight.view(conv.in_channels, -1)  # [channels_in, channels_out x k]
        if weight.numel() > joined[0].numel():  # few steps: the product reads the weight 2-5x faster this way round
            taps = (inputs.T @ weight).T.contiguous()
        else:
            taps = weight.T @ inputs
        # [channels_out, reach, stride, streams, t + reach - 1]: time innermost, so the adds below run over long rows
        taps = taps.view(outputs, reach, stride, streams, -1)
        samples = taps[:, 0, :, :, reach - 1 :] + conv.bias[:, None, None, None]  # [channels_out, stride, streams, t]
        for back in range(1, reach):  # tap group `back` of the input `back` steps earlier
            samples.add_(taps[:, back, :, :, reach - 1 - back : reach - 1 - back + steps])
        return samples.permute(2, 0, 3, 1).reshape(streams, outputs, steps * stride)


def _snake(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """qwen-tts's SnakeBeta, x + (1 / (exp(beta) + eps)) * sin(x exp(alpha))^2, in one new buffer: the same
    operations in the same dtype, so the same bits (pow(s, 2) is s * s)."""
    factors = _SNAKE_FACTORS.get(module)
    if factors is None:
        alpha = torch.exp(module.alpha.detach()[None, :, None])
        inverse = 1.0 / (torch.exp(module.beta.detach()[None, :, None]) + module.no_div_by_zero)
        factors = _SNAKE_FACTORS[module] = (alpha, inverse)
    y = x * factors[0]
    y.sin_()
    y.mul_(y)
    return y.mul_(factors[1]).add_(x)


def _stacked_caches(caches: list) -> object:
    """One attention cache of the streams' caches (the same frames pushed), stacked along the batch; one cache is
    copied as it is (the pass keeps the stream's own until it ends)."""
    stacked = copy.copy(caches[0])
    stacked.layers = [copy.copy(layer) for layer in caches[0].layers]
    for index, layer in enumerate(stacked.layers):
        if layer.is_initialized:
            layer.keys = torch.cat([cache.layers[index].keys for cache in caches])
            layer.values = torch.cat([cache.layers[index].values for cache in caches])
    return stacked


def _cache_row(cache: object, row: int) -> object:
    """One stream's attention cache out of a stacked one."""
    single = copy.copy(cache)
    single.layers = [copy.copy(layer) for layer in cache.layers]
    for layer in single.layers:
        if layer.is_initialized:
            layer.keys, layer.values = layer.keys[row : row + 1].clone(), layer.values[row : row + 1].clone()
    return single
