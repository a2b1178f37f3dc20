"""Shared test settings: deterministic seeds, one torch thread per xdist worker."""

from __future__ import annotations

import os

import pytest
import torch

from attnlab.kernels import calibration

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers on two cores: one thread each, and the same for the CLI subprocesses tests start
    # (they inherit OMP_NUM_THREADS), or every process spins threads against the others.
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True, scope="session")
def _calibration_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """No backend timing (attnlab.kernels.calibration) outside its own tests: every call takes the
    fixed order of the backends that apply, so no result depends on which one a busy machine timed
    fastest, and no test spends time measuring. Its tests turn it on, with the cache in a folder of
    this session, never the user's. The CLI's subprocesses inherit both."""
    os.environ["ATTNLAB_CALIBRATE"] = "0"  # read once, at import: for the CLI's subprocesses
    os.environ["ATTNLAB_CALIBRATION_DIR"] = str(tmp_path_factory.mktemp("calibration"))
    calibration.MEASURING = False  # this process imported it already (collecting the tests)


@pytest.fixture(autouse=True, scope="session")
def _hash_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The SHA-256 and checked-values cache (attnlab.pretrained.provenance) of this session, never
    the user's; the CLI's subprocesses inherit it."""
    os.environ["ATTNLAB_HASH_CACHE"] = str(tmp_path_factory.mktemp("hashes") / "sha256.json")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
