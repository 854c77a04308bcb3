"""The target model: what a spec names and its family (family), --dtype/--device (device), the one-time GGUF
conversion and weight fingerprints (convert), loading with its identity and end-of-turn tokens (load), and
capture of the residual stream by layout with hooks (capture).
"""

import os

# No hub access, ever: every asset is local. Set here, before any target module imports transformers.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
