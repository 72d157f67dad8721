"""The engine: the Qwen3 decoder stack both loops share, run by hand over static KV caches; the talker and
code predictor runners; sampling, trees, offsets and the exact verification walk; the kernels; the frame
loop and the inner loop, one utterance or several at once; the streaming speech decoder."""
