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
