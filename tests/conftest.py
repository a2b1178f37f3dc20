"""Shared test settings: deterministic seeds, one torch thread per xdist worker."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # two workers on two cores: don't oversubscribe


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
