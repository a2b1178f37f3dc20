"""The CLI answers at once: help pages, shell completion and ``attnlab tokenize`` import no torch.

Each check runs in a fresh Python process (this test process has torch loaded already), calls
:func:`attnlab.cli.main` and then looks at ``sys.modules``. The help pages render in click's classic
style (``Usage: attnlab encode [OPTIONS] RUN TEXTS...``, no ``<bool>``), and the choice enums the
CLI defines without torch match the library's own lists.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import typer

from attnlab.cli import app, main
from attnlab.cli.choices import Benchmark, HeadKind, Precision, Split, TokenizerKind

HEAVY = (
    "torch",
    "numpy",
    "attnlab.nn",
    "attnlab.kernels",
    "attnlab.pretrained",
    "gguf",
    "attnlab.experiment",
    "attnlab.tasks",
    "safetensors",
)
"""Modules that neither the help pages nor ``attnlab tokenize`` may load."""

PROBE = """
import contextlib, io, json, sys
from attnlab.cli import main
out = io.StringIO()
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            main(argv)
        except SystemExit as exit:
            code = exit.code
    if code not in (0, None):
        sys.exit(f"{argv}: exit {code}: {out.getvalue()[-500:]}")
print(json.dumps(sorted(name for name in json.loads(sys.argv[2]) if name in sys.modules)))
"""


def _loaded_after(argvs: list[list[str]], env: dict[str, str] | None = None) -> list[str]:
    """The modules of :data:`HEAVY` a fresh process holds after running each of ``argvs``."""
    result = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(argvs), json.dumps(HEAVY)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def _command_paths(command, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:  # noqa: ANN001
    """Every command path below ``command``: ``("eval",)``, ``("heads", "ablate")``, ..."""
    paths = [path]
    for name, sub in getattr(command, "commands", {}).items():
        paths += _command_paths(sub, (*path, name))
    return paths


ALL_COMMANDS = _command_paths(typer.main.get_command(app))


def test_import_of_the_cli_loads_no_torch():
    assert _loaded_after([]) == []


def test_every_help_page_loads_no_torch():
    assert len(ALL_COMMANDS) > 15  # the root, every command, every group and its subcommands
    assert _loaded_after([[*path, "--help"] for path in ALL_COMMANDS]) == []


def test_tokenize_loads_no_torch():
    assert (
        _loaded_after([["tokenize", "--kind", "char", "hello"], ["tokenize", "--kind", "word", "--ids", "ab ab"]]) == []
    )


def test_shell_completion_loads_no_torch():
    env = {"_ATTNLAB_COMPLETE": "complete_bash", "COMP_WORDS": "attnlab eval run --split ", "COMP_CWORD": "4"}
    assert _loaded_after([[]], env=env) == []


def _run(capsys, *argv: str) -> tuple[int, str, str]:  # noqa: ANN001
    with pytest.raises(SystemExit) as exit:
        main(list(argv))
    out, err = capsys.readouterr()
    return exit.value.code, " ".join(out.split()), err


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["encode"], "Usage: attnlab encode [OPTIONS] RUN TEXTS..."),
        (["eval"], "Usage: attnlab eval [OPTIONS] RUN"),
        (["heads", "ablate"], "Usage: attnlab heads ablate [OPTIONS] RUN"),
        (["tokenize"], "Usage: attnlab tokenize [OPTIONS] TEXT"),
        ([], "Usage: attnlab [OPTIONS] COMMAND [ARGS]..."),
    ],
)
def test_help_pages_read_as_click_writes_them(capsys, argv, usage):
    code, out, err = _run(capsys, *argv, "--help")
    assert code == 0 and err == ""
    assert usage in out
    assert "<bool>" not in out and "<path>" not in out and "<list" not in out and "{" not in out.split("│")[0]


def test_help_pages_name_types_and_choices(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # one row per option: choices unbroken
    _, out, _ = _run(capsys, "eval", "--help")
    assert "run PATH" in out and "INTEGER RANGE [1<=x<=65536]" in out
    # eval's splits include the run's length bins (length_LOW_HIGH), so --split is free text
    assert "--split SPLIT" in out and "length_generalisation, or a length bin" in out
    _, out, _ = _run(capsys, "train", "--help")
    assert "[fp32|bf16|fp16]" in out
    _, out, _ = _run(capsys, "tokenize", "--help")
    assert "--kind [word|rule|char|wordpiece|bpe]" in out and "--json <bool>" not in out


def test_choice_enums_match_the_library():
    from attnlab.bench import BENCHMARKS
    from attnlab.experiment import PRECISIONS
    from attnlab.nn import ATTENTION_KINDS
    from attnlab.tasks.base import SPLITS
    from attnlab.tokenizers import KINDS

    assert [s.value for s in Split] == list(SPLITS)
    assert [k.value for k in TokenizerKind] == list(KINDS)
    assert [p.value for p in Precision] == list(PRECISIONS)
    assert [k.value for k in HeadKind] == list(ATTENTION_KINDS)
    assert [b.value for b in Benchmark] == [*BENCHMARKS, "all"]


# Typer detects the user's shell from the process tree (under `make` it finds sh, which it cannot
# complete); its documented test switch makes --show-completion/--install-completion take the
# shell's name instead.
NAMED_SHELL = {"_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"}


def test_show_completion_prints_a_bash_script():
    result = subprocess.run(
        [sys.executable, "-c", "from attnlab.cli import main; main()", "--show-completion", "bash"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **NAMED_SHELL},
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = " ".join(result.stdout.split())
    assert "_ATTNLAB_COMPLETE=complete_bash" in out and "complete -o default -F _attnlab_completion attnlab" in out


def test_completion_offers_the_choices():
    env = {
        **os.environ,
        "_ATTNLAB_COMPLETE": "complete_bash",
        "COMP_WORDS": "attnlab tokenize --kind w",
        "COMP_CWORD": "3",
    }
    result = subprocess.run(
        [sys.executable, "-c", "from attnlab.cli import main; main()"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["word", "wordpiece"]


def test_the_public_api_keeps_its_names():
    """``import attnlab`` loads no torch (see above); each public name comes from attnlab.nn (or the module
    ``attnlab._ELSEWHERE`` names) on first use."""
    import importlib

    import attnlab

    for name in attnlab.__all__:
        home = importlib.import_module(attnlab._ELSEWHERE.get(name, "attnlab.nn"))
        assert getattr(attnlab, name) is getattr(home, name, attnlab.__version__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        attnlab.nope  # noqa: B018


def test_install_completion_writes_the_script_into_home(tmp_path):
    env = {**os.environ, **NAMED_SHELL, "HOME": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", "from attnlab.cli import main; main()", "--install-completion", "bash"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    scripts = list(tmp_path.rglob("attnlab*"))
    assert scripts and "_attnlab_completion" in scripts[0].read_text()
    assert str(scripts[0].relative_to(tmp_path)) in (tmp_path / ".bashrc").read_text()
