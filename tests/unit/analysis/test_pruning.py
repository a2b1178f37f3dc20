"""Physical pruning of a run with heads held at zero: train.mask_heads follows the renumbering."""

from __future__ import annotations

import pytest

from attnlab.analysis.pruning import prune_model, renumber_heads, write_pruned_run
from attnlab.errors import UsageError
from attnlab.evaluation import evaluate
from attnlab.head_ids import HeadId
from attnlab.run.loaded import open_run
from tests.unit.analysis.tiny_runs import tiny_run


@pytest.fixture(scope="module")
def held_run(tmp_path_factory):
    return tiny_run(tmp_path_factory.mktemp("pruning"), "held")  # holds cross:0:0 and encoder_self:0:1


def _valid(loaded, head_mask):  # noqa: ANN001, ANN202
    result = evaluate(
        loaded.model,
        loaded.task,
        "valid",
        kind="encoder_decoder",
        batch_size=128,
        max_length=loaded.model.config.max_len,
        tokenizer=None,
        head_mask=head_mask,
    )
    return float(result["accuracy"]), float(result["loss"])


def test_renumber_drops_pruned_heads_and_shifts_the_others_down():
    pruned = [HeadId("self", 0, 0), HeadId("self", 0, 2), HeadId("self", 1, 1)]
    heads = [
        HeadId("self", 0, 3),
        HeadId("self", 0, 2),
        HeadId("self", 0, 1),
        HeadId("self", 1, 0),
        HeadId("cross", 0, 3),
    ]
    assert renumber_heads(heads, pruned) == [
        HeadId("self", 0, 1),
        HeadId("self", 0, 0),
        HeadId("self", 1, 0),
        HeadId("cross", 0, 3),
    ]


def test_pruned_run_renumbers_its_held_heads_and_evaluates_like_the_masked_original(held_run, tmp_path):
    loaded = open_run(held_run)
    # cross:0:0 is held and pruned: it leaves the list. encoder_self:0:0 is pruned, so the held
    # encoder_self:0:1 becomes encoder_self:0:0 of the pruned run.
    pruned = [HeadId("cross", 0, 0), HeadId("encoder_self", 0, 0)]
    smaller = prune_model(loaded.model, pruned)
    write_pruned_run(loaded, smaller, tmp_path / "pruned", pruned=pruned)
    again = open_run(tmp_path / "pruned")
    assert again.experiment.train.mask_heads == ["encoder_self:0:0"]
    assert again.experiment.model["heads_per_layer"]["encoder_self"] == [1, 2]
    assert _valid(again, again.held_mask()) == pytest.approx(_valid(loaded, loaded.held_mask(pruned)), abs=1e-6)


def test_pruned_heads_must_describe_the_pruned_model(held_run, tmp_path):
    loaded = open_run(held_run)
    smaller = prune_model(loaded.model, [HeadId("cross", 0, 0)])
    with pytest.raises(UsageError, match="2 heads in cross layer 1"):
        write_pruned_run(loaded, smaller, tmp_path / "a", pruned=[HeadId("cross", 0, 1), HeadId("cross", 1, 0)])
    with pytest.raises(UsageError, match="not a head of the original model"):
        write_pruned_run(loaded, smaller, tmp_path / "b", pruned=[HeadId("cross", 0, 7)])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_run_whose_layers_keep_different_head_counts_is_drawn_and_viewed(held_run, tmp_path):
    """After pruning, encoder_self has 1 head in layer 0 and 2 in layer 1: every map, picture and
    viewer answer follows each layer's own head count (stacking the layers had raised)."""
    from starlette.testclient import TestClient

    from attnlab.analysis.maps import attention_view, kind_maps
    from attnlab.analysis.plots import attention_figures
    from attnlab.viewer import create_app

    loaded = open_run(held_run)
    pruned = [HeadId("encoder_self", 0, 0)]
    write_pruned_run(loaded, prune_model(loaded.model, pruned), tmp_path / "pruned", pruned=pruned)
    again = open_run(tmp_path / "pruned")
    view = attention_view(again, "abcd")
    assert [m.shape[0] for m in kind_maps(view, "encoder_self")] == [1, 2]
    stems = [stem for stem, _ in attention_figures(view)]
    assert "encoder_self_layer0_head0" in stems and "encoder_self_layer0_head1" not in stems
    assert "encoder_self_layer1_head1" in stems
    answer = TestClient(create_app(again)).post("/api/run", json={"text": "abcd"})
    assert answer.status_code == 200
    layers = [m for m in answer.json()["attention"] if m["kind"] == "encoder_self"]
    assert [len(m["weights"]) for m in layers] == [1, 2]
