"""Doctor stage: wiring checks, layout inference, the serve-flag lint and the trace."""
