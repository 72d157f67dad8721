"""Synthesis of utterances: the request's settings, text chunks, batch files and sizes, the pipeline over the
frame loop, the loader and the Synthesizer."""
