"""The networks and what runs them: the Qwen3 decoder stack over static KV caches, the talker and code
predictor, the native and torch kernels per device, 8-bit weights, drawing codes from logits, the speech decoder."""
