"""A trained stand-in for the Qwen3-TTS code predictor, built offline from synthetic speech.

Not Qwen3-TTS: a proxy with the real predictor's class and layout, trained on natural(ish) residual
codes, so acceptance and benchmarks can run on non-random distributions. See docs/standin.md.
"""
