"""``attnlab bench tl``'s TransformerLens process (attnlab.bench.peer, attnlab.bench.peer_scripts.tl_peer).

The protocol end to end through a real subprocess, without TransformerLens: a peer script that runs
tl_peer's own request loop (:func:`serve`) over stand-in systems, driven by :func:`run_tl` on a tiny
Llama; each row streamed on stderr as it is measured. The one-line errors of a ``--python`` that is
not there, cannot be run, lacks the modules, or dies. With TransformerLens importable by this
Python, the real peer under ``--python sys.executable`` (slow); without it, that Python's error.
No timing is asserted.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import stat
import sys
from pathlib import Path

import pytest

from attnlab.bench import tl
from attnlab.bench.peer import PeerError, PeerProcess
from attnlab.bench.peer_scripts import tl_peer
from attnlab.bench.tl import run_tl
from attnlab.cli import main
from attnlab.errors import UsageError

pytest.importorskip("transformers", reason="transformers (the [dev] extra) builds the tiny Llama")

HAS_TL = importlib.util.find_spec("transformer_lens") is not None
VERSIONS = {"python": "3", "torch": "2", "transformers": "5", "transformer_lens": "0.0-stand-in"}

STAND_IN = f"""
import sys

sys.path.insert(0, {str(Path(tl_peer.__file__).parent)!r})  # a script's folder, as for the real peer
import tl_peer


def load(spec):
    heads = [(layer, head) for layer in range(spec["layers"]) for head in range(spec["heads"])]
    slices = tl_peer.patch_slices(heads)
    zeros = [[0.0] * spec["heads"] for _ in range(spec["layers"])]
    tasks = {{
        "cache all": lambda: 2_000_000,
        "cache patterns": lambda: 1_000,
        "patch heads": lambda: {{head: -1.5 for head in next(slices)}},
        "importance": lambda: zeros,
        "generate": lambda: None,
    }}
    return {{"stand-in": tasks}}


tl_peer.serve(sys.stdin, tl_peer._protocol_stream(), {VERSIONS!r}, load)
"""

DIES = f"""
import json, sys

print(json.dumps({{"versions": {VERSIONS!r}}}), flush=True)
sys.stdin.readline()
print("loading the stand-in", file=sys.stderr)
raise RuntimeError("the stand-in peer fell over")
"""


def _script(path: Path, text: str, executable: bool = False) -> Path:
    path.write_text(text)
    if executable:
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_rows_stream_as_measured_and_the_peer_answers_through_the_protocol(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tl, "PEER_SCRIPT", _script(tmp_path / "stand_in.py", STAND_IN))
    result = run_tl(quick=True, python=sys.executable)
    values = {(m.system, m.metric): m.value for m in result.results}
    for task in tl_peer.TASKS:
        assert values[("stand-in", f"{task} s")] > 0
        assert math.isfinite(result.ratios[f"{task}.stand-in_vs_attnlab_time"])
    assert values[("stand-in", "cache all cached bytes")] == 2.0  # MB: the bytes the peer sent
    assert values[("stand-in", "importance max |difference| from attnlab")] > 0  # its zeros against attnlab's
    assert math.isfinite(values[("stand-in", "patching max |difference| from attnlab")])
    assert any("TransformerLens 0.0-stand-in in its own process" in note for note in result.notes)
    err = capsys.readouterr().err
    assert "bench tl: starting TransformerLens in" in err
    # each task's rows, then its ratio, before the next task's rows: streamed as measured
    marks = []
    for task in tl_peer.TASKS:
        marks += [re.search(rf"^  stand-in +{task} s ", err, re.M).start(), err.index(f"ratio {task}.stand-in_vs")]
    assert marks == sorted(marks)


@pytest.mark.parametrize("kind", ["missing", "folder", "not executable"])
def test_a_python_that_cannot_be_run_is_one_usage_error_naming_python(tmp_path, kind):
    python = {"missing": tmp_path / "no-python", "folder": tmp_path, "not executable": tmp_path / "python"}[kind]
    if kind == "not executable":
        python.write_text("#!/bin/sh\n")
    with pytest.raises(
        UsageError, match=f"--python {re.escape(str(python))}: .*(no such file|a folder|not executable)"
    ):
        run_tl(quick=True, python=python, progress=False)


def test_a_python_without_the_modules_is_one_usage_error_before_the_model_is_written(tmp_path, capsys):
    bare = _script(tmp_path / "python", f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n', executable=True)
    with pytest.raises(
        UsageError, match=rf"--python {re.escape(str(bare))}: that Python has no torch .*leave --python out"
    ):
        run_tl(quick=True, python=bare, progress=False)
    assert capsys.readouterr().err == ""  # progress=False: not even the step lines


def test_a_peer_that_dies_is_named_with_the_last_line_of_its_stderr(tmp_path):
    with PeerProcess(sys.executable, _script(tmp_path / "dies.py", DIES), "TransformerLens", "--python") as peer:
        assert peer.start() == {"versions": VERSIONS}
        with pytest.raises(PeerError, match="exited with code 1 while load: RuntimeError: the stand-in peer fell over"):
            peer.request("load", folder=str(tmp_path))
        log = peer.log
    assert "loading the stand-in" in log.read_text()  # kept, and named in the message
    log.unlink()


def test_the_cli_says_one_line_for_a_missing_python(tmp_path, capsys):
    with pytest.raises(SystemExit) as ended:
        main(["bench", "tl", "--quick", "--python", str(tmp_path / "nothing")])
    err = capsys.readouterr().err.strip()
    assert ended.value.code == 2
    assert err.count("\n") == 0 and err.startswith("error: --python ") and "no such file" in err
    with pytest.raises(SystemExit) as ended:
        main(["bench", "decode", "--quick", "--python", sys.executable])
    assert ended.value.code == 2 and "only `bench tl`" in capsys.readouterr().err


@pytest.mark.skipif(HAS_TL, reason="this Python has TransformerLens: the next test runs it")
def test_this_python_without_transformer_lens_is_named(tmp_path):
    with pytest.raises(UsageError, match=r"--python .*that Python has no transformer_lens"):
        run_tl(quick=True, python=sys.executable, progress=False)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TL, reason="TransformerLens (the bench-tl extra) is not installed")
def test_transformer_lens_in_its_own_process_agrees_with_attnlab(capsys):
    result = run_tl(quick=True, python=sys.executable)
    values = {(m.system, m.metric): m.value for m in result.results}
    assert values[("bridge", "importance max |difference| from attnlab")] < 1e-6
    assert values[("bridge", "patching max |difference| from attnlab")] < 1e-4
    assert re.search(r"^  bridge +generate s ", capsys.readouterr().err, re.M)
    json.dumps(result.to_json())
