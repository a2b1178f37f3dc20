"""The console script: --help, --version, info, and exit code 2 for usage errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from attnlab import __version__


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "attnlab", *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_version():
    result = _run("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"attnlab {__version__}"


def test_help_lists_commands():
    result = _run("--help")
    assert result.returncode == 0
    assert "info" in result.stdout


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (("train", "--help"), "[train] keys"),
        (("attribute", "--help"), "logit[answer] - logit[wrong]"),
        (("sweep", "--help"), "[sweep.grid]"),
        (("heads", "--help"), "Head analysis"),
    ],
)
def test_help_prints_brackets_as_written(args, text):
    """Help texts name TOML tables and indices in brackets; none is read as markup and dropped."""
    result = _run(*args, env={**os.environ, "COLUMNS": "250"})  # one row per option: no break inside the text
    assert result.returncode == 0
    assert text in result.stdout


def test_info_json():
    result = _run("info", "--json")
    facts = json.loads(result.stdout)
    assert facts["scores"] == ["additive", "bilinear", "dot", "scaled_dot"]
    assert facts["normalizers"] == ["hardmax", "softmax"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("no-such-command",), "error: attnlab: No such command 'no-such-command'."),
        (("info", "--no-such-flag"), "error: attnlab info: No such option: --no-such-flag"),
    ],
)
def test_usage_errors_exit_2_with_one_line(args, message):
    result = _run(*args)
    assert result.returncode == 2
    assert result.stderr == message + "\n" and result.stdout == ""


def test_library_errors_become_exit_2(monkeypatch, capsys):
    from attnlab import cli
    from attnlab.cli.app import app
    from attnlab.errors import ConfigError

    @app.command("raise-config-error", hidden=True)
    def _boom() -> None:
        raise ConfigError("model.heads: must be a positive integer, got -1")

    try:
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["raise-config-error"])
    finally:
        app.registered_commands.pop()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == "error: model.heads: must be a positive integer, got -1"
