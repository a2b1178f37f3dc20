"""The analyses as methods of ``LanguageModel`` (attnlab.lm.studies), on a tiny random byte-level
Llama-style run in float64: a batch gives what its examples give one by one (patching's metric is
the mean over the batch, left padding included), the tensors hold what the rows hold, and bad
input is one clear error."""

from __future__ import annotations

import pytest
import torch

from attnlab.analysis.detectors import PATTERNS
from attnlab.analysis.patching import patch
from attnlab.errors import UsageError
from attnlab.lm import LanguageModel
from attnlab.run.loaded import open_run
from tests.unit.analysis.tiny_lm import tiny_lm_run

# IOI-shaped prompt pairs of different lengths (one token per byte): the corrupt input swaps a name
CLEAN = ["When Mary and John went, John gave it to", "When Tom and Ann sat, Ann gave it to"]
CORRUPT = ["When Mary and John went, Mary gave it to", "When Tom and Ann sat, Tom gave it to"]
ANSWERS, WRONGS = ["M", "T"], ["J", "A"]


@pytest.fixture(scope="module")
def lm(tmp_path_factory) -> LanguageModel:
    run, _ = tiny_lm_run(tmp_path_factory.mktemp("studies"))
    loaded = open_run(run)
    loaded.model.double()
    return LanguageModel(loaded)


def _first_tokens(lm: LanguageModel, texts: list[str]) -> list[int]:
    return [lm.loaded.tokenizer.encode(text)[0] for text in texts]


@pytest.mark.parametrize("method", ["exact", "attribution"])
def test_patching_a_batch_gives_the_mean_of_its_examples_patched_alone(lm, method) -> None:
    answers, wrongs = _first_tokens(lm, ANSWERS), _first_tokens(lm, WRONGS)
    result = lm.patch(CLEAN, CORRUPT, answer=answers, wrong=wrongs, method=method, verify_top=3, progress=False)
    alone = [
        patch(lm.loaded, c, x, answer=a, wrong=w, sites=["heads"], method=method, verify_top=3)
        for c, x, a, w in zip(CLEAN, CORRUPT, answers, wrongs, strict=True)
    ]
    layers, heads = lm.head_mask_shapes["self"]
    assert result.dims("heads") == ("layer", "head") and result["heads"].shape == (layers, heads)
    assert result.metric_clean == pytest.approx(sum(a.metric_clean for a in alone) / 2, rel=1e-9)
    assert result.metric_corrupt == pytest.approx(sum(a.metric_corrupt for a in alone) / 2, rel=1e-9)
    patched = (alone[0].tensor("heads", "metric") + alone[1].tensor("heads", "metric")) / 2
    torch.testing.assert_close(result.tensor("heads", "metric"), patched, rtol=1e-7, atol=1e-9)
    gap = result.metric_clean - result.metric_corrupt
    torch.testing.assert_close(result["heads"], (patched - result.metric_corrupt) / gap, rtol=1e-6, atol=1e-9)
    if method == "attribution":  # the verified units are the exact patches of the same batch
        exact = lm.patch(CLEAN, CORRUPT, answer=answers, wrong=wrongs, progress=False)["heads"]
        verified = result.tensor("heads", "exact")
        assert int((~verified.isnan()).sum()) == 3
        torch.testing.assert_close(verified[~verified.isnan()], exact[~verified.isnan()], rtol=1e-7, atol=1e-9)


def test_patching_position_by_position_gives_a_positions_axis_and_the_residual_its_sites(lm) -> None:
    answers, wrongs = _first_tokens(lm, ANSWERS), _first_tokens(lm, WRONGS)
    result = lm.patch(
        CLEAN, CORRUPT, answer=answers, wrong=wrongs, sites=["heads", "residual"], positions="each", progress=False
    )
    width = max(len(lm.tokenize(text)) for text in CLEAN)
    assert result.dims("heads") == ("layer", "head", "position")
    assert result["heads"].shape == (*lm.head_mask_shapes["self"], width)
    assert result.dims("residual") == ("site", "position") and result["residual"].shape == (3, width)
    torch.testing.assert_close(result["residual"][-1, -1], torch.tensor(1.0, dtype=torch.float64))  # all of it
    assert len(result.corrupt_tokens) == width  # the first example's labels, padded where it is shorter
    shorter = lm.patch(CLEAN[::-1], CORRUPT[::-1], answer=answers[::-1], wrong=wrongs[::-1], progress=False)
    assert shorter.corrupt_tokens[0] == "<pad>" and len(shorter.corrupt_tokens) == width
    assert len(result.to_frame()) == len(result.rows()) and set(result.to_frame().columns) >= {"restored", "head"}


def test_patching_ids_is_patching_their_texts(lm) -> None:
    by_text = lm.patch(CLEAN[0], CORRUPT[0], answer=ANSWERS[0], wrong=WRONGS[0], progress=False)
    ids = torch.tensor(lm.tokenize(CLEAN[0])), torch.tensor(lm.tokenize(CORRUPT[0]))
    by_ids = lm.patch(*ids, answer=ANSWERS[0], wrong=WRONGS[0], progress=False)
    torch.testing.assert_close(by_ids["heads"], by_text["heads"], rtol=0, atol=0)


def test_attribution_of_a_batch_stacks_each_prompts_and_the_terms_sum_to_the_logit(lm) -> None:
    batch = lm.attribute(CLEAN, ANSWERS, WRONGS)
    one = lm.attribute(CLEAN[1], ANSWERS[1], WRONGS[1])
    assert batch.head_effects.shape == (2, *lm.head_mask_shapes["self"])
    torch.testing.assert_close(batch.head_effects[1], one.head_effects, rtol=0, atol=0)
    logits = lm(CLEAN[1])[0, -1].detach()
    good, bad = _first_tokens(lm, [ANSWERS[1], WRONGS[1]])
    assert one.value == pytest.approx(float(logits[good] - logits[bad]), rel=1e-9)
    assert float(one.head_effects.sum() + one.layer_effects[:, 1].sum()) == pytest.approx(
        sum(t.contribution for t in one.terms if ".attn.head." in t.term or t.term.endswith(".ffn")), rel=1e-9
    )
    assert one.total == pytest.approx(one.value, rel=1e-9)
    assert one.lens is not None and len(one.lens.rows) == lm.model.config.layers + 1


def test_importance_of_a_list_a_file_and_ids_agree_and_max_texts_caps_them(lm, tmp_path) -> None:
    texts = ["the cat sat on the mat", "a dog barked at it", "colourless green ideas sleep"]
    path = tmp_path / "texts.txt"
    path.write_text("\n".join(texts) + "\n", encoding="utf-8")
    of_list = lm.importance(texts, progress=False)
    torch.testing.assert_close(lm.importance(path, progress=False).tensor, of_list.tensor, rtol=1e-12, atol=0)
    tokens, mask = lm.to_tokens(texts, return_mask=True)
    torch.testing.assert_close(
        lm.importance(tokens, is_token=mask, progress=False).tensor, of_list.tensor, rtol=1e-9, atol=1e-12
    )
    capped = lm.importance(path, max_texts=1, progress=False)
    torch.testing.assert_close(capped.tensor, lm.importance(texts[:1], progress=False).tensor, rtol=0, atol=0)
    head, score = of_list.top(1)[0]
    assert score == float(of_list.tensor.max()) and of_list.tensor[head.layer, head.head] == score


def test_ablation_and_detection_tensors_hold_their_rows(lm) -> None:
    found = lm.ablate(["the cat sat on the mat", "a dog barked at it"], progress=False)
    deltas = found.deltas()
    for row in found.single:
        assert deltas["self"][row.layer, row.head] == row.delta
    detection = lm.detect(length=8, batch_size=2, progress=False)
    for name in PATTERNS:
        scores = detection.scores(name)
        for row in detection.rows:
            value = getattr(row, name)
            assert value != value or scores["self"][row.layer, row.head] == value  # NaN: not scored


def test_masking_heads_by_name_is_the_head_mask_with_those_heads_off(lm) -> None:
    xi = lm.head_mask()
    xi["self"][1, 2] = 0.0
    with lm.masking_heads(xi):
        by_mask = lm(CLEAN, return_type="loss").detach()
    with lm.masking_heads(["self:1:2"]):
        by_name = lm(CLEAN, return_type="loss").detach()
    assert float(by_name) == float(by_mask) != float(lm(CLEAN, return_type="loss").detach())


def test_a_batch_generates_what_each_prompt_generates_alone(lm) -> None:
    batch = lm.generate(CLEAN + ["ab"], max_new_tokens=5)
    assert batch == [lm.generate(text, max_new_tokens=5) for text in CLEAN + ["ab"]]
    sampled = lm.generate(CLEAN, max_new_tokens=5, temperature=1.0, seed=3)
    assert sampled == lm.generate(CLEAN, max_new_tokens=5, temperature=1.0, seed=3)


def test_prepend_bos_is_chosen_for_the_call_or_once_for_the_model(lm) -> None:
    text = "the cat"
    assert lm.to_tokens(text)[0].tolist() == lm.tokenize(text) == lm.loaded.tokenizer.encode(text)
    with pytest.raises(UsageError, match="prepend_bos: .* has no BOS token"):
        lm.to_tokens(text, prepend_bos=True)
    with_bos = LanguageModel(lm.loaded.__class__(**{**lm.loaded.__dict__, "task": _with_bos_id(lm.loaded.task)}))
    assert with_bos.to_tokens(text, prepend_bos=True)[0].tolist() == [7, *lm.tokenize(text)]
    assert with_bos.to_tokens(text)[0].tolist() == lm.tokenize(text)  # as the tokenizer does: no BOS


def _with_bos_id(task):  # noqa: ANN001, ANN202
    from dataclasses import replace

    return replace(task, bos=7)


def test_bad_input_is_one_clear_error(lm) -> None:
    with pytest.raises(UsageError, match=r"--answer: ' Mary' is 5 tokens"):
        lm.patch(CLEAN, CORRUPT, answer=" Mary", wrong="J", progress=False)
    with pytest.raises(UsageError, match=r"--clean: token id 999 is out of range"):
        lm.patch([5, 6, 999], [5, 6, 7], progress=False)
    with pytest.raises(UsageError, match="--clean: a batch of one type is needed"):
        lm.patch(["the cat", [5, 6, 7]], ["the mat", [5, 6, 8]], progress=False)
    with pytest.raises(UsageError, match="inputs: a batch of one type is needed"):
        lm(["the cat", [5, 6, 7]])
    with pytest.raises(UsageError, match=r"inputs: token id 300 is out of range"):
        lm(torch.tensor([[5, 300]]))
    with pytest.raises(UsageError, match="--answer: 3 tokens for a batch of 2"):
        lm.patch(CLEAN, CORRUPT, answer=["M", "T", "J"], wrong="J", progress=False)
    with pytest.raises(UsageError, match="answer: 1 values for a batch of 2 prompts"):
        lm.attribute(CLEAN, ["M"])
    with pytest.raises(UsageError, match="head 'self:9:0': layer 9 is out of range"):
        lm.masking_heads(["self:9:0"])
    with pytest.raises(UsageError, match="max_texts: must be >= 1"):
        lm.importance(["the cat sat"], max_texts=0)


def test_results_draw_pictures_and_write_tables_of_their_tensors(lm, tmp_path) -> None:
    import csv

    answers, wrongs = _first_tokens(lm, ANSWERS), _first_tokens(lm, WRONGS)
    patched = lm.patch(CLEAN, CORRUPT, answer=answers, wrong=wrongs, sites=["heads", "residual"], progress=False)
    scores = lm.importance(["the cat sat on the mat", "a dog barked"], progress=False)
    attribution = lm.attribute(CLEAN[0], ANSWERS[0], WRONGS[0])
    for name, draw in {
        "patch": lambda path: patched.plot("heads", path=path),
        "residual": lambda path: patched.plot("residual", path=path),
        "importance": lambda path: scores.plot(path=path),
        "attribution": lambda path: attribution.plot(path=path),
    }.items():
        draw(tmp_path / f"{name}.png")
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(scores.to_csv(tmp_path / "importance.csv"), newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == scores.tensor.numel()
    for row in rows:
        assert float(row["importance"]) == pytest.approx(float(scores["self"][int(row["layer"]), int(row["head"])]))
    with open(patched.to_csv(tmp_path / "patch.csv"), newline="", encoding="utf-8") as handle:
        assert len(list(csv.DictReader(handle))) == len(patched.rows())


def test_the_notebook_view_and_a_replaced_site_are_methods_too(lm) -> None:
    view = lm.show_patterns("the cat sat", layer=1)
    html = view._repr_html_()
    assert "<script" in html and "the cat sat" in view.html()
    site = "decoder.1.resid_post"
    linear = torch.nn.Linear(24, 24, dtype=torch.float64)
    with torch.no_grad(), lm.trace([f"{site}.error"], replace={site: linear}, keep_error=True) as t:
        kept = lm("the cat sat")
    with torch.no_grad():
        plain = lm("the cat sat")
    torch.testing.assert_close(kept, plain, rtol=1e-9, atol=1e-9)  # the error added back: the model as it was
    assert t.cache[f"{site}.error"].shape == (1, 11, 24)
