"""Corpus runs through the CLI (`attnlab eval --texts`, `attnlab heads importance | ablate | detect --texts`):
two processes give the one-process result, an interrupted run resumes to the uninterrupted one
(on one process or two), and bad corpora and options get one `error:` line."""

from __future__ import annotations

import csv
import json
import os
import random
import re
import socket
import subprocess
import sys

import pytest

import attnlab.analysis.corpus as corpus
from attnlab.cli import main
from tests.cli import attnlab
from tests.unit.analysis.tiny_lm import tiny_lm_run
from tests.unit.pretrained.tiny_bert import write_tiny_bert

WORDS = "the cat sat on a mat dog ran far away big small red x".split()


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    """A tiny language model (1 layer) and 45 texts: 3 windows of batches of 2 on one process."""
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5))) for _ in range(45)]
    return tiny_lm_run(tmp_path_factory.mktemp("cli_corpus"), texts=lines, layers=1)


def _main(capsys, *args: str) -> tuple[int, str, str]:  # noqa: ANN001
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out, err = capsys.readouterr()
    return int(exit_info.value.code or 0), out, err


def _importances(path) -> list[float]:  # noqa: ANN001
    with open(path, newline="") as handle:
        return [float(row["importance"]) for row in csv.DictReader(handle)]


def _interrupt_after_first_state(monkeypatch) -> None:  # noqa: ANN001
    """Stop a run as Ctrl-C would, just after it saved its first state."""
    save = corpus._save_state

    def save_then_stop(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
        save(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(corpus, "_save_state", save_then_stop)


def test_two_processes_give_the_one_process_perplexity(lm) -> None:
    run, texts = lm
    one = attnlab("eval", str(run), "--texts", str(texts), "--batch-size", "2", "--json", one_thread=True)
    two = attnlab("eval", str(run), "--texts", str(texts), "--batch-size", "2", "--json", "--nproc", "2")
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    assert two.stdout.count("\n") == 1  # one result, from the first process
    a, b = json.loads(one.stdout), json.loads(two.stdout)
    assert {k: a[k] for k in ("texts", "tokens", "skipped")} == {k: b[k] for k in ("texts", "tokens", "skipped")}
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=1e-9)


def test_two_processes_detect_the_one_process_scores(lm, tmp_path) -> None:
    run, texts = lm
    common = ("heads", "detect", str(run), "--texts", str(texts), "--batch-size", "2", "--length", "8", "--json")
    one = attnlab(*common, "--out", str(tmp_path / "one"), one_thread=True)
    two = attnlab(*common, "--out", str(tmp_path / "two"), "--nproc", "2")
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    assert two.stdout.count("\n") == 1  # one result, from the first process
    a, b = json.loads(one.stdout)["heads"], json.loads(two.stdout)["heads"]
    assert [(h["layer"], h["head"], h["positional_offset"]) for h in a] == [
        (h["layer"], h["head"], h["positional_offset"]) for h in b
    ]
    for name in ("previous_token", "duplicate_token", "induction", "bos", "positional"):
        assert [h[name] for h in b] == pytest.approx([h[name] for h in a], rel=0, abs=1e-6), name
    assert not (tmp_path / "two" / "detect.resume.json").exists()


def test_a_sentence_encoders_corpus_runs_on_two_processes(lm, tmp_path) -> None:
    """A sentence encoder's --texts (embedding fidelity) is a corpus run too: importance and
    ablation on two processes give the one-process result."""
    from attnlab.pretrained.bert import find_source, import_bert

    run = tmp_path / "bert"
    import_bert(find_source(write_tiny_bert(tmp_path / "src", initializer_range=0.1)), run)
    _, texts = lm
    for command, read in (("importance", _importances), ("ablate", _ablation_metrics)):
        out = {n: tmp_path / f"{command}-{n}" for n in ("one", "two")}
        where = {n: (out[n].with_suffix(".csv") if command == "importance" else out[n]) for n in out}
        common = ("heads", command, str(run), "--texts", str(texts), "--batch-size", "2", "--no-progress")
        one = attnlab(*common, "--out", str(where["one"]), one_thread=True)
        two = attnlab(*common, "--out", str(where["two"]), "--nproc", "2")
        assert one.returncode == 0, one.stderr
        assert two.returncode == 0, two.stderr
        assert read(where["two"]) == pytest.approx(read(where["one"]), rel=1e-6, abs=1e-9), command


def _ablation_metrics(folder) -> list[float]:  # noqa: ANN001
    with open(folder / "ablation.csv", newline="") as handle:
        return [float(row["metric"]) for row in csv.DictReader(handle)]


def test_an_interrupted_importance_run_resumes_on_one_process_or_two(lm, capsys, monkeypatch, tmp_path) -> None:
    run, texts = lm
    common = ("heads", "importance", str(run), "--texts", str(texts), "--batch-size", "2", "--no-progress")
    code, _, err = _main(capsys, *common, "--out", str(tmp_path / "whole.csv"))
    assert code == 0, err
    whole = _importances(tmp_path / "whole.csv")

    part = tmp_path / "part.csv"
    with monkeypatch.context() as patch:
        _interrupt_after_first_state(patch)
        code, _, err = _main(capsys, *common, "--out", str(part))
    assert code == 130 and not part.exists() and (tmp_path / "part.resume.json").exists()
    code, _, err = _main(capsys, *common, "--out", str(part), "--resume")
    assert code == 0, err
    assert _importances(part) == pytest.approx(whole, rel=0, abs=1e-9)
    assert not (tmp_path / "part.resume.json").exists()  # the finished run's state is gone

    spread = tmp_path / "spread.csv"
    with monkeypatch.context() as patch:
        _interrupt_after_first_state(patch)
        code, _, _ = _main(capsys, *common, "--out", str(spread))
    assert code == 130
    resumed = attnlab(*common, "--out", str(spread), "--resume", "--nproc", "2")
    assert resumed.returncode == 0, resumed.stderr
    assert _importances(spread) == pytest.approx(whole, rel=1e-6, abs=1e-9)


def test_ablation_of_a_corpus_resumes_to_the_uninterrupted_result(lm, capsys, monkeypatch, tmp_path) -> None:
    run, texts = lm
    short = tmp_path / "short.txt"  # two windows: 16 texts, then 4
    short.write_text("".join(texts.read_text().splitlines(keepends=True)[:20]))
    common = ("heads", "ablate", str(run), "--texts", str(short), "--batch-size", "2", "--no-progress", "--json")
    code, whole, err = _main(capsys, *common, "--out", str(tmp_path / "whole"))
    assert code == 0, err
    with monkeypatch.context() as patch:
        _interrupt_after_first_state(patch)
        code, _, _ = _main(capsys, *common, "--out", str(tmp_path / "part"))
    assert code == 130
    code, resumed, err = _main(capsys, *common, "--out", str(tmp_path / "part"), "--resume")
    assert code == 0, err
    a, b = json.loads(whole), json.loads(resumed)
    assert a["baseline"] == b["baseline"]
    assert [row["loss"] for row in a["single"] + a["keep_one"]] == [row["loss"] for row in b["single"] + b["keep_one"]]


@pytest.mark.parametrize(
    ("content", "extra", "message"),
    [
        (b"", (), r"^error: \S+corpus\.txt: empty file \(no line with text\)$"),
        (b"\n \n", (), r"^error: \S+corpus\.txt: empty file"),
        (b"the cat\nthe \xff mat\n", (), r"^error: \S+corpus\.txt:2: bytes that are not UTF-8$"),
        (b"the cat\n", ("--resume",), r"^error: --resume: no interrupted run to continue"),
        (b"the cat\n", ("--nproc", "2"), r"^error: --nproc 2: 2 processes on the cpu, but this process may use 1 "),
    ],
)
def test_bad_corpora_and_options_get_one_error_line(lm, capsys, monkeypatch, tmp_path, content, extra, message):
    run, _ = lm
    monkeypatch.setattr("attnlab.devices.cpu_cores", lambda: 1)
    path = tmp_path / "corpus.txt"
    path.write_bytes(content)
    for command in (("eval", str(run)), ("heads", "importance", str(run), "--out", str(tmp_path / "i.csv"))):
        code, _, err = _main(capsys, *command, "--texts", str(path), "--device", "cpu", *extra)
        assert code == 2 and len(err.splitlines()) == 1, err
        assert re.search(message, err.strip()), err


def test_nproc_and_resume_need_a_corpus(lm, capsys) -> None:
    run, _ = lm
    code, _, err = _main(capsys, "heads", "importance", str(run), "--nproc", "2")
    assert code == 2 and err.strip() == "error: --nproc: only for a corpus run; give --texts FILE"
    code, _, err = _main(capsys, "eval", str(run), "--resume")
    assert code == 2 and err.strip() == "error: --resume: only for a corpus run; give --texts FILE"
    code, _, err = _main(capsys, "heads", "detect", str(run), "--nproc", "2")
    assert code == 2 and err.strip() == "error: --nproc: only for a corpus run; give --texts FILE"
    code, _, err = _main(capsys, "heads", "detect", str(run), "--resume")
    assert code == 2 and err.strip() == "error: --resume: only for a corpus run; give --texts FILE"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_two_machines_give_the_one_process_importance(lm, tmp_path) -> None:
    """Two torchrun agents on this machine stand for two machines (--nnodes 2, static rendezvous at
    127.0.0.1): their one process each give the one-process scores."""
    run, texts = lm
    common = ("heads", "importance", str(run), "--texts", str(texts), "--batch-size", "2")
    one = attnlab(*common, "--out", str(tmp_path / "one.csv"), one_thread=True)
    assert one.returncode == 0, one.stderr
    port = str(_free_port())
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "attnlab", *common, "--out", str(tmp_path / "two.csv"), "--nnodes", "2"]
            + ["--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", port],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for rank in (0, 1)
    ]
    finished = [node.communicate(timeout=300) for node in nodes]
    for node, (_, err) in zip(nodes, finished):
        assert node.returncode == 0, err
    assert _importances(tmp_path / "two.csv") == pytest.approx(_importances(tmp_path / "one.csv"), rel=0, abs=1e-6)


@pytest.mark.parametrize(
    "extra, message",
    [
        (("--nnodes", "2"), "error: --master-addr: needed with --nnodes 2 (the address of node 0)"),
        (
            ("--nnodes", "2", "--node-rank", "2", "--master-addr", "h"),
            "error: --node-rank: must lie in [0, --nnodes=2), got 2",
        ),
        (("--master-addr", "h"), "error: --master-addr: only with --nnodes > 1 (one machine finds its own port)"),
    ],
)
def test_bad_machine_options_get_one_error_line(lm, capsys, extra, message) -> None:
    run, texts = lm
    code, _, err = _main(capsys, "heads", "importance", str(run), "--texts", str(texts), *extra)
    assert code == 2 and err.strip() == message
