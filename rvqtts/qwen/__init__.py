"""qwen-tts's parts as rvqtts uses them: checkpoints, prompts, cloned voices and the speech codec."""
