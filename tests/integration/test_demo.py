"""`attnlab demo`: trains in well under 3 minutes and reaches >= 0.95 held-out sequence accuracy."""

from __future__ import annotations

import re
import subprocess
import sys


def test_demo_reaches_its_accuracy_and_draws_attention(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "attnlab", "demo", "--out", str(tmp_path / "demo"), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr
    accuracy = float(re.search(r"held-out sequence accuracy \(test split, 200 strings\): ([0-9.]+)", result.stdout)[1])
    assert accuracy >= 0.95
    examples = re.findall(r"^  (\w+) -> (\w*)$", result.stdout, flags=re.M)
    assert len(examples) == 3
    assert sum(output == source[::-1] for source, output in examples) >= 2
    heatmap = tmp_path / "demo" / "plots" / "attention.png"
    assert f"attention heatmap: {heatmap}" in result.stdout
    assert heatmap.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
