from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """Every test runs with one torch thread. The tiny models gain nothing from intra-op threads, and on a shared
    2-core machine OpenMP's spinning threads made small ops 30-1000x slower (measured in session 1); results are
    identical either way, only the wall time changes. Benchmarks, not tests, measure speed."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def smollm2():
    """The real bundled target, loaded once per session (fp32)."""
    from eyas.target.load import load_target

    return load_target("smollm2-135m", dtype="fp32")
