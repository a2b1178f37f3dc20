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
from attnlab.experiment import ExperimentConfig
from attnlab.head_ids import HeadId, head_ids, mask_without, parse_head
from attnlab.kernels.linear import onednn_available
from attnlab.run.loaded import open_run
from attnlab.training.trainer import train
from tests.unit.analysis.tiny_runs import HELD, tiny_run

EXPERIMENTS = {
    "encoder_decoder": {
        "task": {
            "name": "reverse",
            "max_train_length": 4,
            "train_size": 200,
            "valid_size": 24,
            "test_size": 24,
            "length_generalisation_size": 8,
        },
        "model": {"kind": "encoder_decoder", "layers": 2, "d_model": 16, "heads": 2, "d_ff": 32, "dropout": 0.0},
        "train": {"steps": 40, "batch_size": 16, "lr": 3e-3, "warmup": 5, "log_every": 0},
    },
    "encoder_classifier": {
        "task": {
            "name": "dyck1",
            "max_train_length": 6,
            "train_size": 200,
            "valid_size": 24,
            "test_size": 24,
            "length_generalisation_size": 8,
        },
        "model": {
            "kind": "encoder_classifier",
            "layers": 2,
            "d_model": 16,
            "heads": 2,
            "d_ff": 32,
            "dropout": 0.0,
            "score": "additive",
        },
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


@pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN")
def test_importance_on_the_onednn_kernel_spends_nothing_on_weight_gradients(run, monkeypatch):
    """Importance wants dL/dxi alone: the oneDNN kernel (a custom autograd Function) asks the
    engine which gradients the backward uses and forms no dL/dW, and the scores equal the float64
    model's (F.linear)."""
    import dataclasses

    import attnlab.kernels.linear as linear_module
    from attnlab.nn import build_model

    loaded = open_run(run)
    monkeypatch.setenv("ATTNLAB_LINEAR", "onednn")
    onednn = build_model(loaded.model.config)
    onednn.load_state_dict(loaded.model.state_dict())
    monkeypatch.setenv("ATTNLAB_LINEAR", "aten")
    reference = build_model(loaded.model.config).double()
    reference.load_state_dict(loaded.model.state_dict())
    formed = []
    real = linear_module._weight_gradient
    monkeypatch.setattr(linear_module, "_weight_gradient", lambda *a: formed.append(1) or real(*a))
    scores = {}
    for name, model in (("onednn", onednn), ("float64", reference)):
        probe = TaskProbe(dataclasses.replace(loaded, model=model), "valid", batch_size=8)
        scores[name] = [row.importance for row in importance(probe)]
    assert not formed
    assert scores["onednn"] == pytest.approx(scores["float64"], rel=1e-3, abs=1e-7)


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
    scores = [
        type("R", (), {"kind": h.kind, "layer": h.layer, "head": h.head, "importance": i})()
        for h, i in zip(heads, [0.3, 0.1, 0.2, 0.0])
    ]
    assert pruning_order(scores) == [heads[3], heads[1], heads[2], heads[0]]


@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
def test_pruned_model_equals_masked_model(run, fraction):
    loaded = open_run(run)
    model = loaded.model
    probe = TaskProbe(loaded, "valid")
    heads = head_ids(model)
    pruned = heads[::2][: int(len(heads) * fraction)] if fraction < 1 else heads
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
            PREDICTIONS[kind](model, batch, mask_without(model, expected_off), 0).logits,
            atol=1e-5,
            rtol=1e-5,
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
    torch.testing.assert_close(empty(x), empty.out_proj.bias.expand(2, 3, -1))


# ---- heads held at zero in training (train.mask_heads) ----------------------------------------------


@pytest.fixture(scope="module")
def held_run(tmp_path_factory):
    return tiny_run(tmp_path_factory.mktemp("held"), "held")


def _eval_with_held(loaded):  # noqa: ANN001, ANN202
    """What `attnlab eval` measures: the valid split with the run's held heads masked."""
    from attnlab.evaluation import evaluate

    result = evaluate(
        loaded.model,
        loaded.task,
        "valid",
        kind="encoder_decoder",
        batch_size=128,
        max_length=loaded.model.config.max_len,
        tokenizer=None,
        head_mask=mask_without(loaded.model, [parse_head(s, loaded.model) for s in HELD]),
    )
    return float(result["accuracy"]), float(result["loss"])


def test_held_run_is_measured_as_eval_measures_it(held_run):
    """The ablation baseline and the 0% pruning step are eval's numbers, not the unmasked model's."""
    loaded = open_run(held_run)
    probe = TaskProbe(loaded, "valid")
    expected = _eval_with_held(loaded)
    unmasked = probe.evaluate(None)
    assert unmasked.loss != pytest.approx(expected[1], abs=1e-6)  # the held heads do matter here
    result = ablate(probe)
    assert (result.baseline.metric, result.baseline.loss) == pytest.approx(expected, abs=1e-6)
    zero = pruning_curve(probe, [0])[0]
    assert (zero.heads_pruned, zero.metric, zero.loss) == pytest.approx((0, *expected), abs=1e-6)


def test_held_heads_ablate_to_the_baseline(held_run):
    loaded = open_run(held_run)
    result = ablate(TaskProbe(loaded, "valid"))
    held = {parse_head(s, loaded.model) for s in HELD}
    for row in result.single:
        if HeadId(row.kind, row.layer, row.head) in held:
            assert (row.metric, row.loss, row.delta) == (result.baseline.metric, result.baseline.loss, 0.0)
    # keeping only cross:0:1 in cross layer 0 is the baseline too: its other head is held already
    keep = next(r for r in result.keep_one if (r.kind, r.layer, r.head) == ("cross", 0, 1))
    assert (keep.metric, keep.loss) == (result.baseline.metric, result.baseline.loss)


def test_held_heads_have_importance_zero_and_the_others_their_gradient_at_the_held_mask(held_run):
    """I_h = E_x |dL/dxi_h| for the mask xi * b at xi = 1, b = the held mask: 0 for a held head,
    central finite differences at b for the others (float64)."""
    loaded = open_run(held_run)
    loaded.model.double()
    probe = TaskProbe(loaded, "valid", batch_size=8)
    held = {parse_head(s, loaded.model) for s in HELD}
    scores = {HeadId(r.kind, r.layer, r.head): r.importance for r in importance(probe)}
    assert all(scores[h] == 0.0 for h in held)
    eps = 1e-5
    for head in head_ids(loaded.model):
        if head in held:
            continue
        per_example = []
        for batch in probe.batches():
            losses = []
            for sign in (1.0, -1.0):
                mask = {k: v.double() for k, v in mask_without(loaded.model, held).items()}
                mask[head.kind][head.layer, head.head] = 1.0 + sign * eps
                with torch.no_grad():
                    losses.append(probe.example_losses(batch, mask))
            per_example.append(((losses[0] - losses[1]) / (2 * eps)).abs())
        assert scores[head] == pytest.approx(float(torch.cat(per_example).mean()), rel=1e-3, abs=1e-9), head


def test_pruning_does_not_count_held_heads(held_run):
    """--percent is of the heads that trained; the held ones stay off in every step."""
    from attnlab.analysis.heads import heads_to_remove, live_heads

    loaded = open_run(held_run)
    probe = TaskProbe(loaded, "valid")
    held = [parse_head(s, loaded.model) for s in HELD]
    live = live_heads(probe)
    assert len(live) == len(head_ids(loaded.model)) - len(held) and not set(live) & set(held)
    rows = pruning_curve(probe, [0, 50, 100])
    assert [r.heads_pruned for r in rows] == [0, round(len(live) / 2), len(live)]
    everything = probe.evaluate(mask_without(loaded.model, head_ids(loaded.model)))
    assert (rows[-1].metric, rows[-1].loss) == pytest.approx((everything.metric, everything.loss))
    removed_held, chosen = heads_to_remove(probe, 50)
    assert sorted(removed_held) == sorted(held) and len(chosen) == round(len(live) / 2)
    assert not set(chosen) & set(held)
    half = probe.evaluate(mask_without(loaded.model, [*removed_held, *chosen]))
    assert (half.metric, half.loss) == pytest.approx((rows[1].metric, rows[1].loss))
    only_cross, _ = heads_to_remove(probe, 0, kinds=["cross"])
    assert only_cross == [HeadId("cross", 0, 0)]


def test_an_all_ones_base_mask_analyses_the_held_heads_switched_on(held_run):
    from attnlab.nn import full_head_mask

    loaded = open_run(held_run)
    probe = TaskProbe(loaded, "valid", base_mask=full_head_mask(loaded.model.head_mask_shapes()))
    unmasked = probe.evaluate(None)
    assert ablate(probe, ["cross"]).baseline == unmasked
    assert all(r.importance > 0 for r in importance(probe))
