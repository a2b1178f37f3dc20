"""Learning-rate schedules (Vaswani §5.3) and their LambdaLR wiring."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.experiment import SCHEDULE_NAMES
from attnlab.training.schedule import SCHEDULES, make_scheduler, multiplier


def test_noam_is_vaswani_rescaled_to_peak_at_warmup():
    d_model, warmup = 512, 4000
    peak = d_model**-0.5 * warmup**-0.5
    for step in (1, 100, 3999, 4000, 4001, 20000):
        vaswani = d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
        assert peak * multiplier("noam", step, warmup=warmup, total=0) == pytest.approx(vaswani)
    assert multiplier("noam", 4000, warmup=4000, total=0) == pytest.approx(1.0)


def test_constant_and_cosine():
    assert [multiplier("constant", s, warmup=4, total=10) for s in (1, 2, 4, 9)] == [0.25, 0.5, 1.0, 1.0]
    assert multiplier("cosine", 4, warmup=4, total=10) == pytest.approx(1.0)
    assert multiplier("cosine", 7, warmup=4, total=10) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert multiplier("cosine", 10, warmup=4, total=10) == pytest.approx(0.0, abs=1e-12)


def test_scheduler_sets_the_rate_of_each_step():
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=0.1)
    scheduler = make_scheduler(optimizer, "constant", warmup=4, total=10)
    rates = []
    for _ in range(5):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1])


def test_config_names_match_the_registry():
    assert tuple(SCHEDULES) == SCHEDULE_NAMES
    with pytest.raises(ValueError, match="schedule: unknown 'linear'"):
        make_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1), "linear", warmup=1, total=1)
