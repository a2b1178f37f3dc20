from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.sweep.tiny import TINY


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sweep") / "tiny.toml"
    path.write_text(TINY)
    return path
