"""Michel et al.'s pruning protocol: per-layer normalised ranking, importance on one split and the
curve on another, and fine-tuning with the pruned heads held off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attnlab.analysis.heads import TaskProbe, heads_to_remove, importance, pruning_curve
from attnlab.analysis.retrain import fine_tune
from attnlab.cli import main
from attnlab.errors import UsageError
from attnlab.experiment import ExperimentConfig
from attnlab.head_ids import HeadId, mask_without
from attnlab.nn.head_subsets import head_subset_state
from attnlab.run.loaded import open_run
from attnlab.training.trainer import TrainingDiverged, train

EXPERIMENT = {
    "task": {
        "name": "dyck1",
        "max_train_length": 10,
        "train_size": 64,
        "valid_size": 24,
        "test_size": 24,
        "length_generalisation_size": 4,
    },
    "model": {"kind": "encoder_classifier", "layers": 3, "d_model": 16, "heads": 4, "d_ff": 32, "dropout": 0.0},
    "train": {"steps": 15, "batch_size": 16, "lr": 3e-3, "warmup": 4, "log_every": 0, "threads": 1},
}


pytestmark = pytest.mark.filterwarnings("ignore::attnlab.errors.AttnlabWarning")  # splits this small are warned about


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A recognition classifier with 3 layers x 4 heads = 12 heads."""
    path = tmp_path_factory.mktemp("runs") / "run"
    train(ExperimentConfig.from_dict(EXPERIMENT), path, progress=False)
    return path


def _hand_normalised_order(rows) -> list[HeadId]:  # noqa: ANN001
    """Michel §4.2 by hand, in float64: each importance over the l2 norm of its layer's, ranked
    ascending (ties by kind, layer, head)."""
    norms: dict[tuple[str, int], float] = {}
    for r in rows:
        norms[(r.kind, r.layer)] = norms.get((r.kind, r.layer), 0.0) + r.importance**2
    scored = [(r.importance / norms[(r.kind, r.layer)] ** 0.5, r.kind, r.layer, r.head) for r in rows]
    return [HeadId(kind, layer, head) for _, kind, layer, head in sorted(scored)]


def test_normalize_per_layer_prunes_in_the_hand_computed_order(run):
    loaded = open_run(run)
    probe = TaskProbe(loaded, "valid")
    raw = importance(probe)
    by_hand = _hand_normalised_order(raw)
    raw_order = [HeadId(r.kind, r.layer, r.head) for r in sorted(raw, key=lambda r: r.importance)]
    assert by_hand != raw_order  # normalising changes the ranking of this run: the test can tell them apart
    for percent, count in ((25, 3), (50, 6), (75, 9)):
        _, chosen = heads_to_remove(probe, percent, normalize_per_layer=True)
        assert chosen == by_hand[:count]
    curve = pruning_curve(probe, [50], normalize_per_layer=True)
    expected = probe.evaluate(mask_without(loaded.model, by_hand[:6]))
    assert (curve[0].metric, curve[0].loss) == pytest.approx((expected.metric, expected.loss))


def test_importance_on_one_split_and_the_curve_on_another(run):
    loaded = open_run(run)
    valid, test = TaskProbe(loaded, "valid"), TaskProbe(loaded, "test")
    curve = pruning_curve(test, [0, 50], ranking_probe=valid)
    order = [
        HeadId(r.kind, r.layer, r.head)
        for r in sorted(importance(valid), key=lambda r: (r.importance, r.kind, r.layer, r.head))
    ]
    baseline = test.evaluate(None)
    pruned = test.evaluate(mask_without(loaded.model, order[:6]))
    assert (curve[0].metric, curve[0].loss) == pytest.approx((baseline.metric, baseline.loss))
    assert (curve[1].metric, curve[1].loss) == pytest.approx((pruned.metric, pruned.loss))
    valid_scores = [r.importance for r in importance(valid)]
    test_scores = [r.importance for r in importance(test)]
    assert valid_scores != pytest.approx(test_scores)  # the two splits give other importances


def test_the_cli_names_its_splits_and_measures_on_them(run, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["heads", "prune", str(run), "--percent", "0", "50", "--out", str(tmp_path), "--json", "--no-progress"])
    out = json.loads(capsys.readouterr().out)
    assert exit_info.value.code in (0, None)
    assert (out["importance_split"], out["split"], out["metric_name"]) == ("valid", "test", "test accuracy")
    loaded = open_run(run)
    expected = pruning_curve(TaskProbe(loaded, "test"), [0, 50], ranking_probe=TaskProbe(loaded, "valid"))
    assert [row["metric"] for row in out["curve"]] == pytest.approx([row.metric for row in expected])
    with pytest.raises(SystemExit):
        main(["heads", "prune", str(run), "--percent", "50", "--importance-split", "test", "--split", "valid",
              "--normalize-per-layer", "--out", str(tmp_path), "--no-progress"])  # fmt: skip
    text = capsys.readouterr().out
    assert "importance on test, curve on valid; importances normalised per layer (l2)" in text


def _head_weights(model, head: HeadId) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """The weights that belong to ``head`` alone: its rows of W_Q, W_K, W_V (and biases), its columns of W^O."""
    site = next(s for s in model.attention_sites() if (s.kind, s.layer) == (head.kind, head.layer))
    state = head_subset_state(site.module, [head.head])
    state.pop("out_proj.bias", None)  # shared by every head of the layer
    return {name: tensor.clone() for name, tensor in state.items()}


def test_retraining_changes_the_weights_and_keeps_the_pruned_heads_off(run):
    loaded = open_run(run)
    model = loaded.model
    pruned = [HeadId("self", 0, 1), HeadId("self", 1, 0), HeadId("self", 2, 3)]
    mask = mask_without(model, pruned)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    heads_before = {head: _head_weights(model, head) for head in pruned}
    losses = fine_tune(loaded, mask, 3)
    assert len(losses) == 3 and not model.training
    after = model.state_dict()
    assert any(not torch.equal(before[name], after[name]) for name in before)
    for head in pruned:  # a head with xi_h = 0 gets no gradient: its own weights do not move
        assert all(torch.equal(heads_before[head][n], t) for n, t in _head_weights(model, head).items())
    kept = HeadId("self", 0, 0)
    assert any(
        not torch.equal(before_t, _head_weights(model, kept)[n])
        for n, before_t in _head_weights_of(before, loaded, kept).items()
    )


def test_retraining_steps_past_the_cap_are_refused_before_any_step(run):
    """``--retrain-steps 1000000000`` once ran for ever; the library refuses it as the CLI does."""
    loaded = open_run(run)
    with pytest.raises(UsageError, match=r"--retrain-steps: must lie in \[0, 10,000,000\].*got 1,000,000,000"):
        fine_tune(loaded, None, 10**9)


def test_retraining_refuses_a_non_finite_loss_before_updating(run):
    loaded = open_run(run)
    model = loaded.model
    site = next(iter(model.attention_sites()))
    with torch.no_grad():
        site.module.out_proj.weight[0, 0] = float("inf")  # every output, hence the loss, is no longer finite
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(TrainingDiverged, match=r"--retrain-steps: fine-tuning step 1 of 3 gave loss nan"):
        fine_tune(loaded, mask_without(model, []), 3)
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)  # no update was applied
    assert not model.training


def _head_weights_of(state, loaded, head):  # noqa: ANN001, ANN202
    """``_head_weights`` of a model holding ``state``."""
    fresh = open_run(loaded.run.path)
    fresh.model.load_state_dict(state)
    return _head_weights(fresh.model, head)


def test_pruning_curve_with_retraining_measures_the_fine_tuned_masked_model(run):
    loaded = open_run(run)
    probe = TaskProbe(loaded, "test")
    weights = {name: tensor.clone() for name, tensor in loaded.model.state_dict().items()}
    seen: list[dict[str, torch.Tensor]] = []

    def retrain(mask) -> None:  # noqa: ANN001
        seen.append(mask)
        fine_tune(loaded, mask, 2)

    curve = pruning_curve(probe, [0, 50], ranking_probe=TaskProbe(loaded, "valid"), retrain=retrain)
    state = loaded.model.state_dict()
    assert all(torch.equal(weights[name], state[name]) for name in weights)  # put back afterwards
    # the 50% point: fine-tune the original weights with that mask, measure under the same mask
    twin = open_run(run)
    fine_tune(twin, seen[1], 2)
    expected = TaskProbe(twin, "test").evaluate(seen[1])
    assert (curve[1].metric, curve[1].loss) == pytest.approx((expected.metric, expected.loss))
    untrained = TaskProbe(open_run(run), "test").evaluate(seen[1])
    assert curve[1].loss != pytest.approx(untrained.loss)  # retraining changed what was measured
    assert int((seen[1]["self"] == 0).sum()) == 6 and int((seen[0]["self"] == 0).sum()) == 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--retrain-steps", "2", "--physical", "--out", "{tmp}/new"), "error: --retrain-steps: not with --physical"),
        (("--importance-split", "test", "--texts", "{tmp}/t.txt"), "error: --importance-split and --split: only for"),
    ],
)
def test_prune_options_that_do_not_go_together_are_one_line_errors(run, tmp_path, capsys, extra, message):
    (tmp_path / "t.txt").write_text("()\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["heads", "prune", str(run), "--percent", "10", *(a.format(tmp=tmp_path) for a in extra)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith(message) and err.count("\n") == 1
