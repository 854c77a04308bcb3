"""eyas: EAGLE-3 speculative decoding with the hidden-state wiring checked end to end."""

__version__ = "0.2.0"
