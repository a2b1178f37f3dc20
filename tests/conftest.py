"""Shared test settings: deterministic seeds, one torch thread per xdist worker."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers on two cores: one thread each, and the same for the CLI subprocesses tests start
    # (they inherit OMP_NUM_THREADS), or every process spins threads against the others.
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
