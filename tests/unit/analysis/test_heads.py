"""Head analysis: importance = finite differences, ablation and pruning curves, physical pruning."""

from __future__ import annotations

import copy

import pytest
import torch

from attnlab.analysis.heads import (
    TaskProbe,
    ablate,
    heads_to_prune,
    importance,
    pruning_curve,
    pruning_order,
)
from attnlab.analysis.pruning import prune_model
from attnlab.errors import UsageError
from attnlab.evaluation.objectives import PREDICTIONS
from attnlab.experiment import ExperimentConfig, open_run
from attnlab.head_ids import HeadId, head_ids, mask_without, parse_head
from attnlab.training.trainer import train

EXPERIMENTS = {
    "encoder_decoder": {
        "task": {"name": "reverse", "max_train_length": 4, "train_size": 200, "valid_size": 24, "test_size": 24,
                 "length_generalisation_size": 8},
        "model": {"kind": "encoder_decoder", "layers": 2, "d_model": 16, "heads": 2, "d_ff": 32, "dropout": 0.0},
        "train": {"steps": 40, "batch_size": 16, "lr": 3e-3, "warmup": 5, "log_every": 0},
    },
    "encoder_classifier": {
        "task": {"name": "dyck1", "max_train_length": 6, "train_size": 200, "valid_size": 24, "test_size": 24,
                 "length_generalisation_size": 8},
        "model": {"kind": "encoder_classifier", "layers": 2, "d_model": 16, "heads": 2, "d_ff": 32, "dropout": 0.0,
                  "score": "additive"},
        "train": {"steps": 40, "batch_size": 16, "lr": 3e-3, "warmup": 5, "log_every": 0},
    },
}


@pytest.fixture(scope="module", params=sorted(EXPERIMENTS))
def run(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "run"
    train(ExperimentConfig.from_dict(EXPERIMENTS[request.param]), path, progress=False)
    return path


def test_importance_equals_central_finite_differences(run):
    """I_h = E_x |dL(x)/dxi_h| at xi = 1 against (L(1 + e) - L(1 - e)) / 2e, in float64."""
    loaded = open_run(run)
    loaded.model.double()
    probe = TaskProbe(loaded, "valid", batch_size=8)
    scores = {HeadId(r.kind, r.layer, r.head): r.importance for r in importance(probe)}
    eps = 1e-5
    for head in head_ids(loaded.model):
        per_example = []
        for batch in probe.batches():
            losses = []
            for sign in (1.0, -1.0):
                mask = {k: v.double() for k, v in mask_without(loaded.model, ()).items()}
                mask[head.kind][head.layer, head.head] = 1.0 + sign * eps
                with torch.no_grad():
                    losses.append(probe.example_losses(batch, mask))
            per_example.append(((losses[0] - losses[1]) / (2 * eps)).abs())
        expected = float(torch.cat(per_example).mean())
        assert scores[head] == pytest.approx(expected, rel=1e-3, abs=1e-9), head


def test_importance_normalized_per_layer(run):
    probe = TaskProbe(open_run(run), "valid")
    rows = importance(probe, normalize_per_layer=True)
    for kind, layer in {(r.kind, r.layer) for r in rows}:
        norm = sum(r.importance**2 for r in rows if (r.kind, r.layer) == (kind, layer)) ** 0.5
        assert norm == pytest.approx(1.0)


def test_ablation_rows(run):
    loaded = open_run(run)
    probe = TaskProbe(loaded, "valid")
    result = ablate(probe)
    heads = head_ids(loaded.model)
    assert [(r.kind, r.layer, r.head) for r in result.single] == [(h.kind, h.layer, h.head) for h in heads]
    assert len(result.keep_one) == len(heads)
    for row in result.single:
        assert row.delta == pytest.approx(row.metric - result.baseline.metric)
        direct = probe.evaluate(mask_without(loaded.model, [HeadId(row.kind, row.layer, row.head)]))
        assert (direct.metric, direct.loss) == pytest.approx((row.metric, row.loss))


def test_pruning_curve_steps(run):
    probe = TaskProbe(open_run(run), "valid")
    total = len(head_ids(probe.model))
    rows = pruning_curve(probe, [50, 0, 100])
    assert [r.percent for r in rows] == [0, 50, 100]
    assert [r.heads_pruned for r in rows] == [0, round(total / 2), total]
    assert (rows[0].metric, rows[0].loss) == pytest.approx((probe.evaluate(None).metric, probe.evaluate(None).loss))
    recomputed = pruning_curve(probe, [0, 50, 100], recompute=True, keep_one_per_layer=True)
    layers = len({(h.kind, h.layer) for h in head_ids(probe.model)})
    assert recomputed[-1].heads_pruned == total - layers  # one head left in every layer


def test_heads_to_prune_respects_order_and_layers():
    heads = [HeadId("self", 0, 0), HeadId("self", 0, 1), HeadId("self", 1, 0), HeadId("self", 1, 1)]
    order = [heads[0], heads[1], heads[3], heads[2]]
    assert heads_to_prune(order, 2) == [heads[0], heads[1]]
    assert heads_to_prune(order, 2, keep_one_per_layer=True) == [heads[0], heads[3]]
    assert heads_to_prune(order, 4, keep_one_per_layer=True) == [heads[0], heads[3]]
    scores = [type("R", (), {"kind": h.kind, "layer": h.layer, "head": h.head, "importance": i})()
              for h, i in zip(heads, [0.3, 0.1, 0.2, 0.0])]
    assert pruning_order(scores) == [heads[3], heads[1], heads[2], heads[0]]


@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
def test_pruned_model_equals_masked_model(run, fraction):
    loaded = open_run(run)
    model = loaded.model
    probe = TaskProbe(loaded, "valid")
    heads = head_ids(model)
    pruned = heads[:: 2][: int(len(heads) * fraction)] if fraction < 1 else heads
    smaller = prune_model(model, pruned)
    assert smaller.num_parameters() < model.num_parameters()
    kind = loaded.experiment.model_kind
    for batch in probe.batches():
        with torch.no_grad():
            masked = PREDICTIONS[kind](model, batch, mask_without(model, pruned), 0).logits
            cut = PREDICTIONS[kind](smaller, batch, None, 0).logits
        torch.testing.assert_close(cut, masked, atol=1e-5, rtol=1e-5)


def test_pruning_twice_composes(run):
    model = open_run(run).model
    first = [HeadId(h.kind, h.layer, h.head) for h in head_ids(model) if h.head == 0]
    once = prune_model(model, first)
    twice = prune_model(once, [h for h in head_ids(once)][:1])
    expected_off = first + [next(h for h in head_ids(model) if h.head == 1)]
    probe = TaskProbe(open_run(run), "valid")
    batch = next(iter(probe.batches()))
    kind = "encoder_decoder" if hasattr(model, "decoder") else "encoder_classifier"
    with torch.no_grad():
        torch.testing.assert_close(
            PREDICTIONS[kind](twice, batch, None, 0).logits,
            PREDICTIONS[kind](model, batch, mask_without(model, expected_off), 0).logits, atol=1e-5, rtol=1e-5,
        )


def test_head_names_are_checked(run):
    model = open_run(run).model
    kind = model.attention_sites()[0].kind
    assert parse_head(f"{kind}:1:1", model) == HeadId(kind, 1, 1)
    for spec, message in [
        (f"{kind}:7:0", "layer 7 is out of range"),
        (f"{kind}:0:9", "head 9 is out of range"),
        ("nowhere:0:0", "this run has no 'nowhere' attention"),
        ("cross-0-1", "expected kind:layer:head"),
    ]:
        with pytest.raises(UsageError, match=message):
            parse_head(spec, model)
    with pytest.raises(UsageError, match="this run has no 'nowhere' attention"):
        head_ids(model, ["nowhere"])
    with pytest.raises(UsageError, match="outside"):
        pruning_curve(TaskProbe(open_run(run), "valid"), [10, 101])


def test_keep_zero_heads_in_a_layer_gives_only_the_output_bias(run):
    model = copy.deepcopy(open_run(run).model)
    site = model.attention_sites()[0]
    layer_heads = [HeadId(site.kind, site.layer, h) for h in range(site.module.heads)]
    smaller = prune_model(model, layer_heads)
    empty = next(s for s in smaller.attention_sites() if (s.kind, s.layer) == (site.kind, site.layer)).module
    assert empty.heads == 0 and empty.in_proj_weight.shape[0] == 0
    x = torch.randn(2, 3, empty.d_model)
    torch.testing.assert_close(empty(x).output, empty.out_proj.bias.expand(2, 3, -1))
