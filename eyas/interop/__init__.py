"""Interop stage: SGLang/SpecForge, vLLM and speculators formats; export and import of drafts."""
