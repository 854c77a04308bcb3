"""Doctor stage: the wiring checks (measured with eyas.probe's layout inference), the serve-flag lint, the serving
check and the trace."""
