"""No hub access, ever: every asset is local. Set explicitly by the CLI's entry and by load_target (the library's
way in to transformers), so offline mode never depends on which module happened to be imported first."""

from __future__ import annotations

import os

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def hub_offline() -> None:
    """Keep transformers and huggingface_hub off the network; a value the user set is left as it is."""
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
