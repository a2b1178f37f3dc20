"""`attnlab eval --texts` and `attnlab heads ... --texts` on a language model (a tiny random
Llama-style pretrained_lm run): perplexity over a text file, head importance, the pruning curve,
and physical pruning of grouped-query attention, through the CLI."""

from __future__ import annotations

import json
import math

import pytest

from attnlab.cli import main
from attnlab.run.loaded import open_run
from tests.unit.analysis.tiny_lm import tiny_lm_run


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return tiny_lm_run(tmp_path_factory.mktemp("cli_lm"))


def _main(capsys, *args: str) -> tuple[int, str, str]:  # noqa: ANN001
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out, err = capsys.readouterr()
    return int(exit_info.value.code or 0), out, err


def test_eval_texts_reports_perplexity_and_counts(lm, capsys) -> None:
    run, texts = lm
    code, out, err = _main(capsys, "eval", str(run), "--texts", str(texts), "--json")
    assert code == 0, err
    metrics = json.loads(out)
    assert metrics["perplexity"] == pytest.approx(math.exp(metrics["loss"]))
    assert (metrics["texts"], metrics["skipped"], metrics["truncated"]) == (5, 1, 0)
    code, masked, _ = _main(capsys, "eval", str(run), "--texts", str(texts), "--json", "--mask-head", "self:0:1")
    assert code == 0 and json.loads(masked)["loss"] != metrics["loss"]
    code, out, _ = _main(capsys, "eval", str(run), "--texts", str(texts))
    assert code == 0 and f"perplexity: {metrics['perplexity']:.4f}" in out and "tokens: " in out


def test_eval_texts_refuses_or_cuts_a_text_longer_than_the_context(lm, capsys, tmp_path) -> None:
    run, _ = lm
    long = tmp_path / "long.txt"
    long.write_text("a short one\n" + "q" * 100 + "\n", encoding="utf-8")
    code, _, err = _main(capsys, "eval", str(run), "--texts", str(long))
    assert code == 2 and err.startswith("error: ") and "long.txt:2" in err and "--truncate" in err
    code, out, err = _main(capsys, "eval", str(run), "--texts", str(long), "--truncate", "--json")
    assert code == 0 and json.loads(out)["truncated"] == 1 and "cut 1 of 2 texts" in err


def test_eval_texts_needs_a_language_model(capsys, tmp_path) -> None:
    from tests.unit.analysis.tiny_runs import tiny_run

    texts = tmp_path / "t.txt"
    texts.write_text("hello there\n", encoding="utf-8")
    code, _, err = _main(capsys, "eval", str(tiny_run(tmp_path, "encoder_classifier")), "--texts", str(texts))
    assert code == 2 and "needs a language model run of text" in err


def test_importance_and_the_pruning_curve_score_every_query_head(lm, capsys, tmp_path) -> None:
    run, texts = lm
    code, out, err = _main(
        capsys, "heads", "importance", str(run), "--texts", str(texts), "--out", str(tmp_path / "i.csv"), "--json"
    )
    assert code == 0, err
    data = json.loads(out)
    assert data["metric_name"].startswith("perplexity") and len(data["importance"]) == 12
    code, out, err = _main(
        capsys,
        "heads",
        "prune",
        str(run),
        "--texts",
        str(texts),
        "--percent",
        "0",
        "50",
        "100",
        "--out",
        str(tmp_path),
        "--json",
    )
    assert code == 0, err
    curve = json.loads(out)["curve"]
    assert [row["heads_pruned"] for row in curve] == [0, 6, 12]
    code, baseline, _ = _main(capsys, "eval", str(run), "--texts", str(texts), "--json")
    assert curve[0]["metric"] == pytest.approx(json.loads(baseline)["perplexity"])


def test_physical_pruning_writes_a_run_that_computes_the_masked_model(lm, capsys, tmp_path) -> None:
    run, texts = lm
    out_run = tmp_path / "pruned"
    code, out, err = _main(
        capsys,
        "heads",
        "prune",
        str(run),
        "--texts",
        str(texts),
        "--percent",
        "75",
        "--physical",
        "--out",
        str(out_run),
        "--json",
    )
    assert code == 0, err
    result = json.loads(out)
    assert len(result["pruned"]) == 9 and result["max_difference"] < 1e-4
    assert result["parameters"]["after"] < result["parameters"]["before"]
    config = open_run(out_run).model.config
    assert sum(config.heads_per_layer["self"]) == 3 and len(config.kv_groups["self"]) == 2
    _, curve, _ = _main(
        capsys, "heads", "prune", str(run), "--texts", str(texts), "--percent", "75", "--out", str(tmp_path), "--json"
    )
    _, pruned_eval, _ = _main(capsys, "eval", str(out_run), "--texts", str(texts), "--json")
    assert json.loads(pruned_eval)["loss"] == pytest.approx(json.loads(curve)["curve"][0]["loss"], abs=1e-5)
