"""``attnlab verify RUN [--json]``: exit 0 on a clean run, 3 naming each damaged file, in process."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest

from attnlab.cli import main
from tests.tiny_run import build_tiny_run


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    return build_tiny_run(tmp_path_factory.mktemp("verify"))[1]


@pytest.fixture
def copy(tiny_run, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_run, tmp_path / "run"))


def _attnlab(capsys, monkeypatch, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # main() replaces it
    with pytest.raises(SystemExit) as exited:
        main(["verify", *args])
    out, err = capsys.readouterr()
    return exited.value.code or 0, out, err


def test_a_clean_run_exits_0_and_lists_every_file(copy, capsys, monkeypatch):
    (copy / ".lock").write_text("4242\n")  # the run lock of a writer: not a run file
    (copy / "analysis").mkdir()
    (copy / "analysis" / "importance.csv").write_text("anything")
    (copy / "checkpoints" / "step-00000009.partial").mkdir()  # left by a killed checkpoint write
    code, out, err = _attnlab(capsys, monkeypatch, str(copy))
    assert code == 0, err
    listed = [line.split()[1] for line in out.splitlines()[:-1]]
    assert listed[:4] == ["manifest.json", "config.json", "tokenizer.json", "model.safetensors"]
    assert "checkpoints/step-00000004/trainer_state.safetensors" in listed
    assert not any(".lock" in p or "analysis" in p or "plots" in p or ".partial" in p for p in listed)
    assert out.splitlines()[-1].endswith("no problems") and err == ""


def test_damage_exits_3_with_one_error_line_naming_the_file(copy, capsys, monkeypatch):
    path = copy / "checkpoints" / "step-00000002" / "trainer_state.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x10
    path.write_bytes(bytes(data))
    code, out, err = _attnlab(capsys, monkeypatch, str(copy))
    assert code == 3
    assert err.count("\n") == 1 and err.startswith("error: ") and str(path) in err and "sha256 differs" in err
    assert "damaged    checkpoints/step-00000002/trainer_state.safetensors" in out


def test_json_report(copy, capsys, monkeypatch):
    (copy / "config.json").write_text("{}")
    code, out, err = _attnlab(capsys, monkeypatch, str(copy), "--json")
    report = json.loads(out)
    assert code == 3 and report["ok"] is False
    assert [p["path"] for p in report["problems"]] == ["config.json"]
    assert "size 2 bytes, expected" in report["problems"][0]["detail"]
    assert {f["status"] for f in report["files"]} == {"ok", "damaged"}


def test_an_old_run_without_manifests_is_a_warning(copy, capsys, monkeypatch):
    for manifest in copy.rglob("manifest.json"):
        manifest.unlink()
    code, out, err = _attnlab(capsys, monkeypatch, str(copy), "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] and len(report["warnings"]) == 1  # one for the run and its checkpoints
    assert "has no manifest.json" in report["warnings"][0]


def test_a_folder_that_is_not_a_run_is_a_usage_error(tmp_path, capsys, monkeypatch):
    code, _, err = _attnlab(capsys, monkeypatch, str(tmp_path))
    assert code == 2 and err.startswith("error: ") and "not a run directory" in err


def _flip_a_digit(path: Path) -> None:
    text = path.read_text()
    at = max(i for i, c in enumerate(text) if c.isdigit() and c != "9")  # in the last record
    path.write_text(text[:at] + str(int(text[at]) + 1) + text[at + 1 :])


@pytest.mark.parametrize(
    ("damage", "named", "says"),
    [
        (lambda run: (run / "checkpoint.json").unlink(), "checkpoint.json", "checkpoint pointer not found"),
        (
            lambda run: (run / "checkpoints/step-00000004/manifest.json").unlink(),
            "checkpoints/step-00000004/manifest.json",
            "manifest not found",
        ),
        (
            lambda run: (run / "checkpoints/step-00000002/manifest.json").unlink(),
            "checkpoints/step-00000002/manifest.json",
            "manifest not found",
        ),
        (
            lambda run: _flip_a_digit(run / "metrics.jsonl"),
            "metrics.jsonl",
            "differ from what checkpoint step-00000004",
        ),
        (
            lambda run: (run / "metrics.jsonl").write_bytes((run / "metrics.jsonl").read_bytes()[:-30]),
            "metrics.jsonl",
            "cut to",
        ),
        (lambda run: (run / "metrics.jsonl").write_bytes(b""), "metrics.jsonl", "cut to 0 bytes"),
        (lambda run: (run / "metrics.jsonl").unlink(), "metrics.jsonl", "metrics not found"),
    ],
    ids=[
        "no-pointer",
        "no-latest-manifest",
        "no-older-manifest",
        "metrics-digit",
        "metrics-cut",
        "metrics-empty",
        "no-metrics",
    ],
)
def test_a_deleted_index_manifest_or_damaged_metrics_exits_3(copy, capsys, monkeypatch, damage, named, says):
    damage(copy)
    code, out, err = _attnlab(capsys, monkeypatch, str(copy))
    assert code == 3, out
    assert err.count("\n") == 1 and err.startswith("error: ") and str(copy / named) in err and says in err
    assert f"damaged    {named}" in out


def test_metrics_written_after_the_last_checkpoint_verify_and_are_counted(copy, capsys, monkeypatch):
    """What a run still training, or killed before its next checkpoint, leaves: lines no record
    covers yet, the last one torn mid-append."""
    with open(copy / "metrics.jsonl", "ab") as handle:
        handle.write(b'{"loss": 2.5, "step": 5}\n{"loss": 2.4, "st')
    code, out, err = _attnlab(capsys, monkeypatch, str(copy))
    assert code == 0, err
    line = next(line for line in out.splitlines() if "metrics.jsonl" in line)
    assert "as checkpoint step-00000004 recorded them; 1 later lines" in line and "a torn last line ignored" in line
