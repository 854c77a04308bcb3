"""Serving acceptance replayed from captured features: rows (the target's greedy replies and stream states,
captured once), the recording standing in for the target, the replay predictor and its planted faults."""
