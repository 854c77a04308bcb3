"""Bench stage: prompt sets and the side-by-side benchmark (HF baselines vs the eyas engine)."""
