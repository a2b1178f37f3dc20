"""`attnlab patch` and `attnlab heads ablate --mean-over` through the command line."""

from __future__ import annotations

import csv
import json

import pytest

from tests.cli import attnlab
from tests.unit.analysis.tiny_runs import tiny_run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_run(tmp_path_factory.mktemp("cli-patch"), "decoder_only")


def test_patch_writes_csvs_heatmaps_and_json(run, tmp_path):
    out = tmp_path / "patching"
    args = ["patch", str(run), "--clean", "the cat", "--corrupt", "the mat", "--answer", "a", "--wrong", "o"]
    result = attnlab(*args, "--out", str(out), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["measure"] == "logit['a'] - logit['o'] at the last position"
    heads, residual = report["groups"]["heads"], report["groups"]["residual"]
    assert len(heads) == 4 and len(residual) == 3 * len(report["corrupt_tokens"])
    with open(out / "heads.csv", newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == ["site", "kind", "layer", "head", "restored", "metric"] and len(rows) == 4
    assert float(rows[3]["restored"]) == pytest.approx(heads[3]["restored"], rel=1e-5)
    with open(out / "residual.csv", newline="", encoding="utf-8") as handle:
        tokens = [r["token"] for r in csv.DictReader(handle)]
    assert tokens[: len(report["corrupt_tokens"])] == report["corrupt_tokens"]  # a token " " stays a cell
    for name in ("heads.png", "residual.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    text = attnlab(*args, "--out", str(out), "--site", "heads")
    assert text.returncode == 0 and "heads restoring most: self:" in text.stdout and "residual" not in text.stdout
    one_at_a_time = attnlab(*args, "--out", str(tmp_path / "one"), "--json", "--batch-size", "1")
    assert one_at_a_time.returncode == 0, one_at_a_time.stderr
    single = json.loads(one_at_a_time.stdout)["groups"]
    for group in ("heads", "residual"):  # the batch is how many patches share a pass, not what they give
        expected = [row["restored"] for row in report["groups"][group]]
        assert [row["restored"] for row in single[group]] == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_attribution_patching_of_site_globs_writes_a_csv_and_heatmap_per_site_with_exact_values(run, tmp_path):
    out = tmp_path / "attribution"
    args = ["patch", str(run), "--clean", "the cat", "--corrupt", "the mat", "--metric", "logprob", "--answer", "at"]
    sites = ["--site", "heads", "--site", "*.ffn.out", "--site", "decoder.1.attn.q_pre", "--positions", "each"]
    result = attnlab(*args, *sites, "--method", "attribution", "--verify-top", "4", "--out", str(out), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["method"] == "attribution"
    assert set(report["groups"]) == {"heads", "*.ffn.out", "decoder.1.attn.q_pre"}  # JSON keys are sorted
    assert report["measure"].startswith("log p('a' 't') after the prompt")
    for group in report["groups"].values():  # the 4 largest |estimates| of each --site
        assert sum(r["exact"] is not None for r in group) == 4
    positions = len(report["corrupt_tokens"])
    assert len(report["groups"]["heads"]) == 2 * 2 * positions  # --positions each: every head at every position
    for stem in ("heads", "all.ffn.out", "decoder.1.attn.q_pre"):
        assert (out / f"{stem}.png").read_bytes()[:4] == b"\x89PNG"
        with open(out / f"{stem}.csv", newline="", encoding="utf-8") as handle:
            table = list(csv.DictReader(handle))
        assert list(table[0])[-3:] == ["restored", "metric", "exact"] and "position" in table[0]
    assert sum(r["exact"] != "" for r in table) == 4
    text = attnlab(*args, *sites[:2], "--method", "attribution", "--out", str(out))
    assert text.returncode == 0, text.stderr
    assert "attribution patching: first-order estimates" in text.stdout and "(exact " in text.stdout


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--clean", "the cat", "--corrupt", "the cats"], "same number of tokens"),
        (["--clean", "the cat", "--corrupt", "the mat", "--site", "neurons"], "--site: site 'neurons': no such site"),
        (["--clean", "the cat", "--corrupt", "the mat", "--site", "*.attn.zz"], "--site: site '*.attn.zz': no such"),
        (["--clean", "the cat", "--corrupt", "the mat", "--metric", "kl"], "--metric: unknown 'kl'"),
        (["--clean", "the cat", "--corrupt", "the mat", "--method", "grad"], "--method: unknown 'grad'"),
        (["--clean", "the cat", "--corrupt", "the mat", "--positions", "some"], "--positions: unknown 'some'"),
        (["--clean", "the cat", "--corrupt", "the mat", "--metric", "logprob", "--answer", ""], "--answer: '' is no"),
        (["--clean", "the cat", "--corrupt", "the mat", "--answer", "ab"], "--answer: 'ab' is 2 tokens"),
        (["--clean", "", "--corrupt", "the mat"], "--clean: empty input"),
    ],
)
def test_bad_patch_input_is_one_error_line(run, extra, message):
    result = attnlab("patch", str(run), *extra)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and message in result.stderr and result.stderr.count("\n") == 1


def test_heads_ablate_mean_over_a_text_file(run, tmp_path):
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat on the mat\na dog <b> & 'quotes'\n", encoding="utf-8")
    zero = attnlab("heads", "ablate", str(run), "--out", str(tmp_path / "z"), "--json")  # on its valid split
    mean = attnlab("heads", "ablate", str(run), "--mean-over", str(texts), "--out", str(tmp_path / "m"), "--json")
    assert zero.returncode == 0 and mean.returncode == 0, mean.stderr
    zero, mean = json.loads(zero.stdout), json.loads(mean.stdout)
    assert (zero["ablation"], mean["ablation"]) == ("zero", "mean")
    assert zero["baseline"] == mean["baseline"]
    assert [r["loss"] for r in zero["single"]] != [r["loss"] for r in mean["single"]]
