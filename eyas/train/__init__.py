"""Training stage: the EAGLE-3 training-time-test loop over captured (or online) features."""
