"""evaluate(): no metric depends on the batch size, and accuracy per length is keyed by the length
that decides each example's split."""

from __future__ import annotations

import pytest
import torch

from attnlab.evaluation.evaluate import evaluate
from attnlab.experiment import ExperimentConfig, model_for_task
from attnlab.tasks.registry import build_task
from tests.toy_corpora import write_number_words

MODEL = {"layers": 1, "d_model": 16, "heads": 2, "d_ff": 32, "dropout": 0.0}
SIZES = {"train_size": 40, "valid_size": 40, "test_size": 40, "length_generalisation_size": 40}


def _untrained(task_section: dict, kind: str):  # noqa: ANN202
    experiment = ExperimentConfig.from_dict({"task": task_section, "model": {"kind": kind, **MODEL}})
    task, tokenizer = build_task(experiment.task)
    torch.manual_seed(0)
    return model_for_task(experiment, task).eval(), task, tokenizer


def test_text_metrics_do_not_depend_on_the_batch_size(tmp_path):
    # An untrained model rarely ends a hypothesis: each runs to the decode limit, which had been
    # taken from the longest reference of its batch (BLEU 16.87 at batch 16, 17.00 at batch 4).
    data = tmp_path / "pairs.tsv"
    write_number_words(data, 300, seed=0, max_digits=6)
    section = {"name": "translation", "train_file": str(data), "tokenizer_kind": "word", "vocab_size": 60}
    model, task, tokenizer = _untrained(section, "encoder_decoder")
    results = [
        evaluate(model, task, "valid", kind="encoder_decoder", batch_size=size, tokenizer=tokenizer)
        for size in (1, 3, 64)
    ]
    assert "bleu" in results[0]
    exact = lambda result: {k: v for k, v in result.items() if k not in ("loss", "perplexity")}  # noqa: E731
    for result in results[1:]:
        assert exact(result) == exact(results[0])  # BLEU, accuracies, accuracy per length
        assert result["loss"] == pytest.approx(results[0]["loss"], rel=1e-6)  # sums in another order


@pytest.mark.parametrize(
    "section,kind",
    [
        ({"name": "addition", "max_train_length": 2, **SIZES}, "encoder_decoder"),
        ({"name": "reverse", "max_train_length": 4, **SIZES}, "encoder_decoder"),
        ({"name": "parity", "max_train_length": 8, **SIZES}, "encoder_classifier"),
    ],
    ids=["addition", "reverse", "parity"],
)
def test_accuracy_by_length_is_keyed_by_the_split_length(section, kind):
    """Addition's splits are by operand width (length generalisation: widths L+1..2L), not by the
    symbols of "a+b"."""
    model, task, _ = _untrained(section, kind)
    for split in ("test", "length_generalisation"):
        result = evaluate(model, task, split, kind=kind, batch_size=16)
        widths = {str(e.length) for e in task.split(split)}
        assert set(result["accuracy_by_length"]) == widths
    L = section["max_train_length"]
    assert {int(n) for n in evaluate(model, task, "length_generalisation", kind=kind)["accuracy_by_length"]} <= set(
        range(L + 1, 2 * L + 1)
    )


def _randomized(kind: str, section: dict):  # noqa: ANN202
    experiment = ExperimentConfig.from_dict(
        {"task": section, "model": {"kind": kind, **MODEL, "randomized_positions": 48, "max_len": 48}}
    )
    task, _ = build_task(experiment.task)
    torch.manual_seed(0)
    return model_for_task(experiment, task).eval(), task


@pytest.mark.parametrize(
    ("kind", "section"),
    [
        ("encoder_classifier", {"name": "parity", "max_train_length": 8, **SIZES}),
        ("decoder_only", {"name": "dyck1", "max_train_length": 8, "formulation": "next_char", **SIZES}),
        ("encoder_decoder", {"name": "reverse", "max_train_length": 8, **SIZES}),
    ],
    ids=["classifier", "next_char", "generating"],
)
def test_randomized_evaluation_positions_come_from_their_own_generator(kind, section):
    """positions_seed draws positions as training does, from a generator of the evaluation's own:
    torch's global generator is untouched, the same seed and split give the same result, and the
    positions are not 0..T-1 (the loss differs from the consecutive evaluation's)."""
    model, task = _randomized(kind, section)
    state = torch.get_rng_state()
    first = evaluate(model, task, "length_generalisation", kind=kind, positions_seed=7)
    again = evaluate(model, task, "length_generalisation", kind=kind, positions_seed=7, batch_size=5)
    assert torch.equal(torch.get_rng_state(), state)
    assert first["positions"] == "randomized"
    assert first["accuracy_by_length"] == again["accuracy_by_length"]  # drawn per split, not per batch order
    assert first["loss"] == pytest.approx(again["loss"], rel=1e-6)
    consecutive = evaluate(model, task, "length_generalisation", kind=kind)
    other_seed = evaluate(model, task, "length_generalisation", kind=kind, positions_seed=8)
    assert "positions" not in consecutive
    assert consecutive["loss"] != first["loss"] != other_seed["loss"]


def test_randomized_evaluation_positions_need_a_model_built_with_them():
    model, task, _ = _untrained({"name": "parity", "max_train_length": 8, **SIZES}, "encoder_classifier")
    with pytest.raises(ValueError, match="randomized_positions: the model was not built with randomized positions"):
        evaluate(model, task, "valid", kind="encoder_classifier", positions_seed=0)


def test_a_held_out_split_reports_its_lengths_strings_and_horizon():
    model, task, _ = _untrained(
        {"name": "dyck1", "max_train_length": 8, "formulation": "next_char", "eval_lengths": [[9, 14]],
         "horizon_threshold": 0.5, **SIZES},
        "decoder_only",
    )  # fmt: skip
    result = evaluate(model, task, "length_9_14", kind="decoder_only")
    assert result["length_range"] == [9, 14] and result["absent_lengths"] == [9, 11, 13]
    assert result["examples_by_length"] == {"10": 14, "12": 13, "14": 13} or sorted(
        result["examples_by_length"].values()
    ) == [13, 13, 14]
    accuracy = {int(n): a for n, a in result["accuracy_by_length"].items()}
    passed = [n for n in sorted(accuracy) if all(accuracy[m] >= 0.5 for m in accuracy if m <= n)]
    assert result["horizon"] == (passed[-1] if passed else 8) and result["horizon_threshold"] == 0.5
    assert result["accuracy_se"] == pytest.approx((result["accuracy"] * (1 - result["accuracy"]) / 40) ** 0.5)
    assert "horizon" not in evaluate(model, task, "test", kind="decoder_only")
