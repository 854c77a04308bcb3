from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest


@pytest.fixture(scope="session")
def smollm2():
    """The real bundled target, loaded once per session (fp32)."""
    from eyas.target import load_target

    return load_target("smollm2-135m", dtype="fp32")
