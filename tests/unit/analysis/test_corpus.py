"""Corpus runs (attnlab.analysis.corpus, attnlab.analysis.corpus_sums): a streamed file gives the
in-memory analyses' results, an interrupted run resumes to the uninterrupted result, and bad files
and states are refused with errors that name them."""

from __future__ import annotations

import json
import random

import pytest
import torch

from attnlab.analysis.corpus import WINDOW_BATCHES, check_corpus, corpus_identity, finish, run_corpus
from attnlab.analysis.corpus_sums import AblationSums, ImportanceSums, PerplexitySums, text_counts
from attnlab.analysis.heads import ablate, importance
from attnlab.analysis.lm_probe import NextTokenLoss, NextTokenProbe
from attnlab.errors import CheckpointError, DataError, UsageError
from attnlab.run.loaded import open_run
from tests.unit.analysis.tiny_lm import tiny_lm_run

WORDS = "the cat sat on a mat dog ran far away big small red x".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The tiny LM (1 layer) and a file of 45 texts with blank lines and a one-token text."""
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5))) for _ in range(45)]
    lines[3] = "x"  # one token: passed over
    lines.insert(10, "")
    lines.insert(20, "   ")
    run, texts = tiny_lm_run(tmp_path_factory.mktemp("corpus"), texts=lines, layers=1)
    return open_run(run), texts


def _identity(texts, **settings):
    return corpus_identity(texts, command="test", **settings)


def test_a_streamed_corpus_gives_the_in_memory_perplexity_importance_and_ablation(corpus) -> None:
    loaded, texts = corpus
    probe = NextTokenProbe(loaded, texts, batch_size=4)
    loss = NextTokenLoss(loaded)
    sums = run_corpus(texts, PerplexitySums(loss), batch_size=3, identity=_identity(texts))
    assert text_counts(sums, texts) == {"texts": probe.texts, "tokens": probe.tokens, "skipped": 1, "truncated": 0}
    assert int(sums["lines"]) == 45
    score = loss.score(float(sums["nll"]), float(sums["tokens"]))
    assert score.loss == pytest.approx(probe.evaluate(probe.base_mask).loss, rel=1e-6)

    objective = ImportanceSums(loss)
    rows = objective.rows(run_corpus(texts, objective, batch_size=3, identity=_identity(texts)))
    expected = importance(probe)
    assert [(r.kind, r.layer, r.head) for r in rows] == [(r.kind, r.layer, r.head) for r in expected]
    torch.testing.assert_close(
        torch.tensor([r.importance for r in rows], dtype=torch.float64),
        torch.tensor([r.importance for r in expected], dtype=torch.float64),
        rtol=1e-5,
        atol=1e-9,
    )

    objective = AblationSums(loss)
    streamed = objective.ablation(run_corpus(texts, objective, batch_size=3, identity=_identity(texts)))
    in_memory = ablate(probe)
    assert streamed.baseline.loss == pytest.approx(in_memory.baseline.loss, rel=1e-6)
    for a, b in zip(streamed.single + streamed.keep_one, in_memory.single + in_memory.keep_one, strict=True):
        assert (a.kind, a.layer, a.head) == (b.kind, b.layer, b.head)
        assert a.loss == pytest.approx(b.loss, rel=1e-6)


class Stop(Exception):
    """Stands for an interruption after some windows."""


def _stop_after(windows: int):
    def check(done: int) -> None:
        if done == windows:
            raise Stop

    return check


def test_an_interrupted_run_resumes_to_the_uninterrupted_result(corpus, tmp_path) -> None:
    loaded, texts = corpus
    objective = ImportanceSums(NextTokenLoss(loaded))
    whole = run_corpus(texts, objective, batch_size=2, identity=_identity(texts))
    state = tmp_path / "state.json"
    with pytest.raises(Stop):
        run_corpus(texts, objective, batch_size=2, identity=_identity(texts), state=state, after_window=_stop_after(1))
    saved = json.loads(state.read_text())
    assert saved["line"] > 1 and saved["sums"]["lines"]["values"] == [2 * WINDOW_BATCHES]
    with pytest.raises(Stop):  # interrupted again, after one more window of the resumed run
        run_corpus(
            texts,
            objective,
            batch_size=2,
            identity=_identity(texts),
            state=state,
            resume=True,
            after_window=_stop_after(1),
        )
    resumed = run_corpus(texts, objective, batch_size=2, identity=_identity(texts), state=state, resume=True)
    assert resumed.keys() == whole.keys()
    for name in whole:
        torch.testing.assert_close(resumed[name], whole[name], rtol=0, atol=1e-9, msg=name)
    finish(state)
    assert not state.exists()


def test_resume_refuses_a_missing_foreign_or_damaged_state(corpus, tmp_path) -> None:
    loaded, texts = corpus
    objective = PerplexitySums(NextTokenLoss(loaded))
    state = tmp_path / "state.json"
    with pytest.raises(UsageError, match="--resume: no interrupted run to continue"):
        run_corpus(texts, objective, batch_size=2, identity=_identity(texts), state=state, resume=True)
    with pytest.raises(Stop):
        run_corpus(texts, objective, batch_size=2, identity=_identity(texts), state=state, after_window=_stop_after(1))
    with pytest.raises(UsageError, match=r"written by another run \(it differs in mask\)"):
        run_corpus(texts, objective, batch_size=2, identity=_identity(texts, mask=[1]), state=state, resume=True)
    state.write_text('{"format": 1, "identity": {}}')
    with pytest.raises((CheckpointError, UsageError)):
        run_corpus(texts, objective, batch_size=2, identity={}, state=state, resume=True)
    state.write_text("{not json")
    with pytest.raises(CheckpointError, match="corpus run state"):
        run_corpus(texts, objective, batch_size=2, identity=_identity(texts), state=state, resume=True)


@pytest.mark.parametrize(
    ("content", "error"),
    [
        (b"", r"empty\.txt: empty file"),
        (b"\n  \n\n", r"empty\.txt: empty file"),
        (b"good line\nbad \xff byte\n", r"empty\.txt:2: bytes that are not UTF-8"),
        (b"ok\n" + b"q" * 20_000 + b"\n", r"empty\.txt:2: line (longer|has)"),
    ],
)
def test_a_bad_corpus_is_refused_naming_the_file_and_line(tmp_path, content, error) -> None:
    path = tmp_path / "empty.txt"
    path.write_bytes(content)
    with pytest.raises(DataError, match=error):
        check_corpus(path)


def test_a_text_longer_than_the_context_names_its_line(corpus, tmp_path) -> None:
    loaded, _ = corpus
    path = tmp_path / "long.txt"
    path.write_text("a short one\n\n" + "q" * 100 + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"long\.txt:3: the text has 100 tokens"):
        run_corpus(path, PerplexitySums(NextTokenLoss(loaded)), batch_size=2, identity={})
    sums = run_corpus(path, PerplexitySums(NextTokenLoss(loaded, truncate=True)), batch_size=2, identity={})
    assert text_counts(sums, path)["truncated"] == 1
    path.write_text("x\n\ny\n", encoding="utf-8")  # one token each: nothing to predict
    sums = run_corpus(path, PerplexitySums(NextTokenLoss(loaded)), batch_size=2, identity={})
    with pytest.raises(DataError, match=r"long\.txt: no text of two tokens or more"):
        text_counts(sums, path)
