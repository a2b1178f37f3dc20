"""Head detectors (attnlab.analysis.detectors) on a tiny language model whose heads are set by hand
to implement each pattern: the detector ranks exactly those heads first, and the others low.

Layer 0's heads are made by their weights: with q and k biases alone (no weights), rotary
positions make a head's scores a function of j - i only, peaked where k = R(-d) q puts them (the
previous token, offset -2); a key reading a dimension that only the BOS embedding has makes a sink.
Layer 1's duplicate-token and induction heads match token content, so their scores are set by an
edit of the ``scores`` site that reads which tokens are equal from the cached embeddings."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.analysis.corpus import WINDOW_BATCHES, corpus_identity, run_corpus
from attnlab.analysis.detectors import ON_TEXTS, PATTERNS, DetectSums, HeadPatterns, detect_heads, pattern_targets
from attnlab.errors import DataError
from attnlab.experiment import ExperimentConfig, model_config_for_task
from attnlab.nn import build_model, trace
from attnlab.pretrained.bert import find_source, import_bert
from attnlab.run.directory import RunDir
from attnlab.run.loaded import open_run
from attnlab.tasks.registry import build_task
from tests.unit.analysis.tiny_lm import byte_tokenizer
from tests.unit.pretrained.tiny_bert import write_tiny_bert

BOS, PAD = ord("!"), ord("e")
HEADS, D_K = 4, 16
LENGTH = 20
EXPECTED = {
    "previous_token": (0, 0),
    "positional": (0, 1),
    "bos": (0, 2),
    "duplicate_token": (1, 0),
    "induction": (1, 1),
}
"""pattern -> the (layer, head) built to implement it."""


def _run(folder):
    model_section = {
        "kind": "decoder_only",
        "layers": 2,
        "d_model": 32,
        "heads": HEADS,
        "d_k": D_K,
        "d_ff": 8,
        "positional": "rope",
        "rope_base": 10.0,
        "rotary_fraction": 0.5,
        "qkv_bias": True,
        "norm": "rms",
        "norm_first": True,
        "bias": False,
        "dropout": 0.0,
        "scale_embeddings": False,
        "max_len": 64,
    }
    task_section = {"name": "pretrained_lm", "max_tokens": 64, "eos": PAD, "pad": PAD, "bos": BOS, "add_bos": True}
    experiment = ExperimentConfig(task=task_section, model=model_section)
    tokenizer = byte_tokenizer()
    task, _ = build_task(experiment.task, saved_tokenizer=tokenizer)
    torch.manual_seed(0)
    model = build_model(model_config_for_task(experiment, task))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.fill_(1.0)
        embedding = model.decoder.embedding.token.weight
        embedding.normal_()
        embedding[:, 0] = 0.0
        embedding[BOS] = 0.0
        embedding[BOS, 0] = 10.0  # only BOS has dimension 0
        _build_layer_0(model.decoder.layers[0].self_attn)
    run = RunDir.create(folder / "run")
    with run.lock():
        run.write_config(experiment.to_dict())
        run.write_tokenizer(tokenizer.to_json())
        run.save_weights(model)
    return run.path


def _build_layer_0(attention) -> None:  # noqa: ANN001
    """Head 0 attends to the previous token, head 1 two tokens back, head 2 to BOS; head 3 is uniform."""
    rotated = attention.rotary.rotary_dim
    q_bias, k_bias = attention.in_proj_bias[: HEADS * D_K], attention.in_proj_bias[HEADS * D_K : 2 * HEADS * D_K]
    k_weight = attention.in_proj_weight[HEADS * D_K : 2 * HEADS * D_K]
    b = torch.zeros(1, 1, 1, D_K)
    b[..., :rotated] = 6.0  # q = b at every position (no weights), rotated by the query's position
    for head, offset in ((0, 1), (1, 2)):
        q_bias[head * D_K : (head + 1) * D_K] = b.flatten()
        # k = R(offset) b: q_i . k_j = b R(j - i + offset) b, largest at j = i - offset
        _, k = attention.rotary(b, b, torch.tensor([offset]))
        k_bias[head * D_K : (head + 1) * D_K] = k.flatten()
    plain = 2 * D_K + rotated  # head 2's first dimension without rotation
    q_bias[plain] = 20.0
    k_weight[plain, 0] = 1.0  # its key reads dimension 0: BOS's alone


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return open_run(_run(tmp_path_factory.mktemp("detect")))


def _content_edits(t) -> None:  # noqa: ANN001
    """Layer 1: head 0 attends to earlier copies of its token, head 1 to the token after them."""

    def equal_tokens():
        embedded = t.cache["decoder.embed"]  # (B, T, d): equal rows are equal tokens
        return (embedded[:, :, None] == embedded[:, None, :]).all(-1)  # (B, T_q, T_k)

    def duplicate(scores):
        earlier = torch.ones_like(scores[0, 0], dtype=torch.bool).tril(-1)
        return scores + 30.0 * (equal_tokens() & earlier)[:, None]

    def induction(scores):
        after = torch.zeros_like(scores[:, 0], dtype=torch.bool)
        after[:, :, 1:] = equal_tokens()[:, :, :-1]  # x_{j-1} = x_i
        earlier = torch.ones_like(scores[0, 0], dtype=torch.bool).tril(-1)
        return scores + 30.0 * (after & earlier)[:, None]

    t.edit("decoder.1.attn.scores", duplicate, heads=[0])
    t.edit("decoder.1.attn.scores", induction, heads=[1])


def _detect(loaded, **options) -> list[HeadPatterns]:  # noqa: ANN001
    with trace(loaded.model, cache="decoder.embed") as t:
        _content_edits(t)
        return detect_heads(loaded, length=LENGTH, batch=4, **options).rows


@pytest.mark.parametrize("pattern", sorted(EXPECTED))
def test_the_detector_finds_exactly_the_head_built_for_each_pattern(loaded, pattern) -> None:  # noqa: ANN001
    rows = _detect(loaded)
    assert len(rows) == 2 * HEADS
    ranked = sorted(rows, key=lambda row: -getattr(row, pattern))
    assert (ranked[0].layer, ranked[0].head) == EXPECTED[pattern]
    assert getattr(ranked[0], pattern) > 0.9
    assert all(getattr(row, pattern) < 0.3 for row in ranked[1:]), [
        (r.layer, r.head, getattr(r, pattern)) for r in ranked
    ]


def test_the_positional_head_reports_its_offset(loaded) -> None:  # noqa: ANN001
    (row,) = [r for r in _detect(loaded) if (r.layer, r.head) == EXPECTED["positional"]]
    assert row.positional_offset == -2


def test_a_score_is_the_mean_attention_on_the_targets(loaded) -> None:  # noqa: ANN001
    """One head's score against the cached pattern and the targets, computed by hand."""
    texts = loaded.run.path.parent / "texts.txt"
    texts.write_text("the cat sat on the mat\nabcabc\n", encoding="utf-8")
    rows = detect_heads(loaded, texts=texts, length=LENGTH, batch=2).rows
    (row,) = [r for r in rows if (r.layer, r.head) == (1, 3)]
    totals, queries = 0.0, 0
    for text in ("the cat sat on the mat", "abcabc"):
        ids = torch.tensor([loaded.task.encode(text)])
        with trace(loaded.model, cache="decoder.1.attn.pattern") as t:
            loaded.model(ids, is_token=torch.ones_like(ids, dtype=torch.bool))
        weights = t.cache["decoder.1.attn.pattern"][0, 3]  # (T, T)
        for i in range(1, ids.shape[1]):
            totals += float(weights[i, 0])
            queries += 1
    assert row.bos == pytest.approx(totals / queries, abs=1e-6)


def test_patterns_left_out_of_texts_are_measured_on_random_repeats(loaded, tmp_path) -> None:  # noqa: ANN001
    texts = tmp_path / "texts.txt"
    texts.write_text("hello there\n", encoding="utf-8")
    with trace(loaded.model, cache="decoder.embed") as t:
        _content_edits(t)
        detection = detect_heads(loaded, texts=texts, length=LENGTH, batch=2)
    assert "random" in detection.measured_on["induction"] and "random" in detection.measured_on["duplicate_token"]
    assert str(texts) in detection.measured_on["previous_token"]
    assert max(detection.rows, key=lambda row: row.induction).head == 1


class Stop(Exception):
    """Stands for an interruption after some windows."""


def _stop_after_first_window(done: int) -> None:
    if done == 1:
        raise Stop


def test_an_interrupted_text_run_resumes_to_the_uninterrupted_sums(loaded, tmp_path) -> None:  # noqa: ANN001
    """Three windows of texts of several lengths (batches of 2): stopped after the first window
    and resumed, the sums equal the uninterrupted run's, and so do the scores."""
    words = "the cat sat on a mat abc xyz".split()
    lines = [" ".join(words[(i + k) % len(words)] for k in range(1 + i % 4)) for i in range(2 * WINDOW_BATCHES * 2 + 5)]
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(lines) + "\n", encoding="utf-8")
    objective = DetectSums(loaded, ON_TEXTS)
    identity = corpus_identity(texts, command="test")
    whole = run_corpus(texts, objective, batch_size=2, identity=identity)
    assert int(whole["texts"]) == len(lines)
    state = tmp_path / "state.json"
    with pytest.raises(Stop):
        run_corpus(
            texts, objective, batch_size=2, identity=identity, state=state, after_window=_stop_after_first_window
        )
    resumed = run_corpus(texts, objective, batch_size=2, identity=identity, state=state, resume=True)
    assert resumed.keys() == whole.keys()
    for name in whole:
        torch.testing.assert_close(resumed[name], whole[name], rtol=0, atol=1e-9, msg=name)
    assert objective.rows(resumed) == objective.rows(whole)


def test_texts_of_one_length_in_one_pass_score_as_each_alone(loaded) -> None:  # noqa: ANN001
    objective = DetectSums(loaded, ON_TEXTS)
    items = [objective.encode(text, where="t") for text in ("abcd", "the cat", "wxyz")]
    together = objective.measure(items)
    alone = [objective.measure([ids]) for ids in items]
    assert int(together["texts"]) == 3
    for name, value in together.items():
        torch.testing.assert_close(value, sum(sums[name] for sums in alone), rtol=1e-6, atol=1e-9, msg=name)


def test_a_text_longer_than_the_context_names_its_line(loaded) -> None:  # noqa: ANN001
    with pytest.raises(
        DataError, match=r"^texts\.txt:3: the text has 101 tokens, more than the model's context of 64$"
    ):
        DetectSums(loaded, ON_TEXTS).encode("q" * 100, where="texts.txt:3")  # BOS + 100


def test_targets_of_a_repeated_sequence() -> None:
    ids = torch.tensor([[0, 5, 6, 7, 5, 6, 7]])  # BOS, then 5 6 7 twice
    ((_, duplicate),) = pattern_targets("duplicate_token", ids)
    ((_, induction),) = pattern_targets("induction", ids)
    assert duplicate[0].nonzero().tolist() == [[4, 1], [5, 2], [6, 3]]
    assert induction[0].nonzero().tolist() == [[4, 2], [5, 3], [6, 4]]
    offsets = [label for label, _ in pattern_targets("positional", ids, window=2)]
    assert offsets == [-2, 0]
    assert [label for label, _ in pattern_targets("positional", ids, causal=False, window=2)] == [-2, 0, 1, 2]
    ((_, bidirectional),) = pattern_targets("duplicate_token", ids, causal=False)
    assert bidirectional[0, 1].nonzero().flatten().tolist() == [4]  # the later copy too


def test_a_bidirectional_encoder_is_scored_without_induction(tmp_path) -> None:
    import_bert(find_source(write_tiny_bert(tmp_path / "src", initializer_range=0.1)), tmp_path / "run")
    detection = detect_heads(open_run(tmp_path / "run"), length=8, batch=2)
    assert detection.rows and all(math.isnan(row.induction) for row in detection.rows)
    assert all(0.0 <= row.previous_token <= 1.0 for row in detection.rows)
    assert any("induction" in note and "bidirectional" in note for note in detection.notes)


def test_every_pattern_has_a_column() -> None:
    assert set(PATTERNS) <= set(HeadPatterns.__dataclass_fields__)
