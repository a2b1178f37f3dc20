"""Fidelity and pair probes on a small random BERT: values, gradients and file errors."""

from __future__ import annotations

import pytest
import torch

from attnlab.analysis.corpus import run_corpus
from attnlab.analysis.corpus_sums import AblationSums, ImportanceSums
from attnlab.analysis.fidelity import FidelityLoss, FidelityProbe, PairProbe, average_ranks, read_pairs, spearman
from attnlab.analysis.heads import ablate, importance
from attnlab.errors import DataError, UsageError
from attnlab.head_ids import head_ids, mask_without
from attnlab.pretrained.bert import find_source, import_bert
from attnlab.run.loaded import open_run
from tests.unit.pretrained.tiny_bert import write_tiny_bert

TEXTS = [
    "the cat sat on the mat.",
    "a big red house",
    "they run fast",
    "one two three",
    "the dog is slow",
    "she was in the tree",
    "blue and red",
    "we sat on it!",
]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bert")
    import_bert(
        find_source(write_tiny_bert(folder / "src", initializer_range=0.1)), folder / "run"
    )  # heads that matter
    return open_run(folder / "run")


@pytest.fixture()
def texts(tmp_path):
    path = tmp_path / "texts.txt"
    path.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    return path


def test_average_ranks_and_spearman():
    assert average_ranks([10, 20, 20, 5]).tolist() == [2.0, 3.5, 3.5, 1.0]
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(0.8)  # 1 - 6*4/(5*24)


def test_fidelity_is_one_unmasked_and_drops_when_heads_go(loaded, texts):
    probe = FidelityProbe(loaded, texts, batch_size=3)
    assert probe.evaluate(None).metric == pytest.approx(1.0, abs=1e-6)
    half = head_ids(loaded.model)[::2]
    masked = probe.evaluate(mask_without(loaded.model, half))
    assert masked.metric < 0.999 and masked.loss == pytest.approx(1 - masked.metric, abs=1e-6)


def test_example_losses_are_one_minus_cosine_with_a_second_order_gradient(loaded, texts):
    probe = FidelityProbe(loaded, texts, batch_size=4)
    batch = next(probe.batches())
    ones = {
        kind: torch.ones(len(batch), *shape, requires_grad=True)
        for kind, shape in loaded.model.head_mask_shapes().items()
    }
    losses = probe.example_losses(batch, ones)
    assert losses.abs().max() < 1e-6  # the value is 1 - cos = 0 at xi = 1 ...
    (grad,) = torch.autograd.grad(losses.sum(), list(ones.values()))
    assert grad.abs().min() > 0  # ... but every head gets a gradient (the projection term)


def test_importance_ranks_heads_like_ablation(loaded, tmp_path):
    import random

    from tests.unit.pretrained.tiny_bert import WORDS

    rng = random.Random(0)
    path = tmp_path / "many.txt"
    path.write_text("\n".join(" ".join(rng.choices(WORDS, k=rng.randint(3, 12))) for _ in range(64)) + "\n")
    probe = FidelityProbe(loaded, path, batch_size=16)
    scores = [r.importance for r in importance(probe)]
    drops = [1 - r.metric for r in ablate(probe).single]
    assert spearman(scores, drops) > 0.8  # 0.98-1.0 over seeds 0-4 of the tiny model


def test_a_streamed_corpus_gives_the_in_memory_importance_and_ablation(loaded, texts):
    """FidelityLoss through the corpus runner (any batch size, a window at a time) gives what
    FidelityProbe gives in memory: each text's projection u depends on the text alone."""
    probe = FidelityProbe(loaded, texts, batch_size=3)
    expected = [row.importance for row in importance(probe)]
    in_memory = ablate(probe)
    for batch_size in (2, 5):
        objective = ImportanceSums(FidelityLoss(loaded))
        sums = run_corpus(texts, objective, batch_size=batch_size, identity={})
        assert int(sums["texts"]) == len(TEXTS)
        assert [row.importance for row in objective.rows(sums)] == pytest.approx(expected, rel=1e-5, abs=1e-9)
        ablation = AblationSums(FidelityLoss(loaded))
        result = ablation.ablation(run_corpus(texts, ablation, batch_size=batch_size, identity={}))
        assert result.baseline.metric == pytest.approx(1.0, abs=1e-6)
        streamed = [value for row in result.single + result.keep_one for value in (row.metric, row.loss)]
        held = [value for row in in_memory.single + in_memory.keep_one for value in (row.metric, row.loss)]
        assert streamed == pytest.approx(held, rel=1e-5, abs=1e-7)
    other_seed = ImportanceSums(FidelityLoss(loaded, seed=1))
    moved = [row.importance for row in other_seed.rows(run_corpus(texts, other_seed, batch_size=2, identity={}))]
    assert moved != pytest.approx(expected, rel=1e-3)  # the projections are drawn, from the seed


def test_pair_probe_metric_and_losses(loaded, tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_text(
        "the cat sat\tthe cat sat\t5\nthe cat sat\tblue tree\t0\nred house\tbig red house\t3\n", encoding="utf-8"
    )
    probe = PairProbe(loaded, path, batch_size=2)
    score = probe.evaluate(None)
    assert -1.0 <= score.metric <= 1.0 and score.loss >= 0
    batch = next(probe.batches())
    rows = loaded.model.head_mask_shapes()["self"]
    xi = {"self": torch.ones(len(batch), *rows, requires_grad=True)}
    losses = probe.example_losses(batch, xi)
    assert losses.shape == (len(batch),)
    assert torch.autograd.grad(losses.sum(), xi["self"])[0].abs().sum() > 0
    identical = probe.evaluate(None)
    assert identical == score  # deterministic


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a\tb\n", "expected 'sentence1<TAB>sentence2<TAB>score'"),
        ("a\tb\tfive\nc\td\t1\n", "'five' is not a number"),
        ("a\t \t1\n", "empty sentence"),
        ("a\tb\t1\nc\td\t1\n", "same score"),
    ],
)
def test_pair_file_errors_name_the_line(tmp_path, text, message):
    path = tmp_path / "pairs.tsv"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(DataError, match=message):
        read_pairs(path)


def test_probes_refuse_runs_that_are_not_encoders(tmp_path, texts):
    from attnlab.experiment import ExperimentConfig
    from attnlab.training.trainer import train

    experiment = {
        "task": {
            "name": "parity",
            "max_train_length": 4,
            "train_size": 20,
            "valid_size": 8,
            "test_size": 8,
            "length_generalisation_size": 4,
        },
        "model": {"kind": "encoder_classifier", "layers": 1, "d_model": 8, "heads": 2, "d_ff": 16},
        "train": {"steps": 1, "batch_size": 4, "log_every": 0},
    }
    train(ExperimentConfig.from_dict(experiment), tmp_path / "run", progress=False)
    with pytest.raises(UsageError, match="sentence encoder"):
        FidelityProbe(open_run(tmp_path / "run"), texts)
