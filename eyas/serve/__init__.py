"""Serve stage: the OpenAI-compatible HTTP server on the speculative engine."""
