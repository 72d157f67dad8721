"""Synthesis for others: the OpenAI-compatible server and batches on a Ray cluster."""
