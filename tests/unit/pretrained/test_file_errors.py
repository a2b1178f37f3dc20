"""Issue 50, item 6: a model folder's file that cannot be read is named for what it is.

A permission-denied ``model.safetensors`` says "permission denied" (exit 2: a file the system
refuses), not "No such file or directory"; a FIFO, ``/dev/zero`` or a symlink loop in its place
says so (exit 3: the folder is damaged), never "no model.safetensors", and a FIFO is never read
(no hang); a damaged tokenizer.json exits 3 as a damaged config.json does. Each through the command
line with a timeout (a fresh process for the weights' FIFO and /dev/zero and for a user without
permission; the others in this process under an alarm): one ``error:`` line naming the file and
the cause, within seconds.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from attnlab.errors import CheckpointError, DataError, UsageError
from attnlab.pretrained.checkpoint import find_checkpoint, is_checkpoint_folder, read_json
from attnlab.reading import DamagedFileError, describe_os_error, file_problem, read_capped
from attnlab.tokenizers import Tokenizer
from tests.unit.pretrained.tiny_hf import build

NOBODY = 65534
"""The user a test drops to when it runs as root (root reads every file, whatever its mode)."""
SECONDS = 60
"""The most a case may take: a command opening a tiny model takes about 3 s on a shared core."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:  # noqa: ANN001
    """A tiny Llama folder (config, weights, tokenizer), every file readable by all."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    build("llama", folder)
    for path in folder.iterdir():
        path.chmod(0o644)
    return folder


@pytest.fixture
def shared(tmp_path) -> Iterator[Path]:  # noqa: ANN001
    """A folder every user may enter (pytest's own are 0700): where a test run as another user
    finds its model."""
    folder = Path(tempfile.mkdtemp(prefix="attnlab-file-errors-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _copy(tiny: Path, shared: Path) -> Path:
    folder = Path(shutil.copytree(tiny, shared / "model"))
    folder.chmod(0o755)
    return folder


def _as_user(user: int) -> list[str]:
    """The prefix that runs a command as ``user`` (from root): setpriv, which this sandbox allows
    where Python's ``subprocess.run(user=)`` cannot exec an interpreter under /root."""
    return ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"]


def _generate(folder: Path, *, as_user: int | None = None) -> tuple[int | None, list[str], float]:
    """``attnlab generate FOLDER hello`` in a fresh process (as ``as_user``, from root): (exit code,
    stderr's lines, seconds); exit code None where it had not ended after :data:`SECONDS`."""
    started = time.monotonic()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("ATTNLAB_TRACEBACK", None)
    prefix = [] if as_user is None else _as_user(as_user)
    try:
        done = subprocess.run(
            [*prefix, sys.executable, "-m", "attnlab", "generate", str(folder), "hello", "--max-length", "2"],
            capture_output=True,
            text=True,
            timeout=SECONDS,
            env=env,
            cwd=folder.parent,
        )
    except subprocess.TimeoutExpired:
        return None, [], time.monotonic() - started
    return done.returncode, [line for line in done.stderr.splitlines() if line.strip()], time.monotonic() - started


def _generate_here(folder: Path, capsys) -> tuple[int | None, list[str], float]:  # noqa: ANN001
    """:func:`_generate` in this process (no interpreter to start), stopped by SIGALRM after
    :data:`SECONDS` (a read that blocks is interrupted)."""
    from attnlab.cli import main

    def expire(signum, frame) -> None:  # noqa: ANN001, ARG001
        raise TimeoutError

    started = time.monotonic()
    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(SECONDS)
    try:
        main(["generate", str(folder), "hello", "--max-length", "2"])
        code: int | None = 0
    except SystemExit as exit_info:
        code = int(exit_info.code or 0)
    except TimeoutError:
        code = None
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return code, lines, time.monotonic() - started


def _one_error(code: int | None, lines: list[str], seconds: float, *, want: int, words: list[str]) -> None:
    assert code is not None, f"no answer after {seconds:.0f} s"
    assert code == want, lines
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "Traceback" not in lines[0] and "Errno" not in lines[0], lines
    for word in words:
        assert word in lines[0], lines
    assert seconds < SECONDS


WEIGHTS = "model.safetensors"
PLACES: dict[str, tuple[Callable[[Path], None], list[str]]] = {
    "a FIFO": (lambda path: os.mkfifo(path), ["a FIFO (named pipe), not a regular file"]),
    "a symlink to /dev/zero": (lambda path: path.symlink_to("/dev/zero"), ["a character device", "/dev/zero"]),
    "a symlink loop": (lambda path: path.symlink_to(path.name), ["a symlink loop", "ELOOP"]),
    "a broken symlink": (lambda path: path.symlink_to("gone.safetensors"), ["'gone.safetensors'", "does not exist"]),
    "a folder": (lambda path: path.mkdir(), ["a folder, not a file"]),
}


@pytest.mark.parametrize("place", ["a FIFO", "a symlink to /dev/zero"])
def test_a_fifo_or_dev_zero_as_the_weights_is_named_in_a_fresh_process(tiny, shared, place) -> None:  # noqa: ANN001
    """As a user meets it: the command, in its own process, answers within seconds (never reads
    the FIFO, never maps /dev/zero)."""
    folder = _copy(tiny, shared)
    (folder / WEIGHTS).unlink()
    make, words = PLACES[place]
    make(folder / WEIGHTS)
    code, lines, seconds = _generate(folder)
    _one_error(code, lines, seconds, want=3, words=[f"{folder / WEIGHTS}:", *words])


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json"])
@pytest.mark.parametrize("place", list(PLACES))
def test_what_stands_in_a_files_place_is_named_exit_3(tiny, shared, capsys, name, place) -> None:  # noqa: ANN001
    """A FIFO, /dev/zero, a symlink loop, a broken symlink or a folder where a file of the model
    belongs: exit 3 naming the file and what is there (the FIFO not read: no hang)."""
    folder = _copy(tiny, shared)
    (folder / name).unlink()
    make, words = PLACES[place]
    make(folder / name)
    code, lines, seconds = _generate_here(folder, capsys)
    _one_error(code, lines, seconds, want=3, words=[f"{folder / name}:", *words])


def test_a_missing_weights_file_says_missing(tiny, shared, capsys) -> None:  # noqa: ANN001
    folder = _copy(tiny, shared)
    (folder / WEIGHTS).unlink()
    code, lines, seconds = _generate_here(folder, capsys)
    _one_error(code, lines, seconds, want=3, words=[str(folder), f"no {WEIGHTS}"])


def _unprivileged() -> int | None:
    """The user to run as so that a file's mode counts: None as an ordinary user (already so),
    :data:`NOBODY` as root; skip where root cannot change user (no setuid in this sandbox)."""
    if os.geteuid() != 0:
        return None
    if shutil.which("setpriv") is None:
        pytest.skip("runs as root, and without setpriv to run a process as another user")
    probe = subprocess.run([*_as_user(NOBODY), sys.executable, "-c", "1"], check=False, capture_output=True)
    if probe.returncode != 0:
        pytest.skip("runs as root and cannot run Python as another user")
    return NOBODY


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json"])
def test_a_file_without_permission_is_permission_denied_exit_2(tiny, shared, name) -> None:  # noqa: ANN001
    """chmod 000: "permission denied (EACCES)" naming the file, exit 2 (a file the system refuses,
    docs/reliability.md), never "No such file or directory". As root the command runs as nobody."""
    user = _unprivileged()
    folder = _copy(tiny, shared)
    (folder / name).chmod(0)
    code, lines, seconds = _generate(folder, as_user=user)
    _one_error(code, lines, seconds, want=2, words=[f"{folder / name}:", "permission denied (EACCES)"])
    assert "No such file" not in lines[0]


@pytest.mark.parametrize("name", ["tokenizer.json", "config.json"])
def test_a_damaged_tokenizer_exits_3_as_a_damaged_config_does(tiny, shared, capsys, name) -> None:  # noqa: ANN001
    """Truncated JSON, in either file: exit 3 naming the file (a damaged file is 3 whichever it is)."""
    folder = _copy(tiny, shared)
    data = (folder / name).read_bytes()
    (folder / name).write_bytes(data[: len(data) // 2])
    code, lines, seconds = _generate_here(folder, capsys)
    _one_error(code, lines, seconds, want=3, words=[f"{folder / name}", "JSON"])


# ---- the library, without a process ----------------------------------------------------------------------


def test_file_problem_names_each_kind_of_file_and_never_opens_a_fifo(tmp_path) -> None:  # noqa: ANN001
    regular = tmp_path / "file"
    regular.write_bytes(b"{}")
    assert file_problem(regular) is None
    missing = file_problem(tmp_path / "nothing")
    assert missing is not None and missing.missing and "missing (no such file) (ENOENT)" in missing.cause
    os.mkfifo(tmp_path / "fifo")  # opening it for reading without a writer would block
    assert file_problem(tmp_path / "fifo").cause == "a FIFO (named pipe), not a regular file"
    (tmp_path / "loop").symlink_to("loop")
    loop = file_problem(tmp_path / "loop")
    assert not loop.missing and "ELOOP" in loop.cause
    assert isinstance(loop.error(), CheckpointError)
    (tmp_path / "zero").symlink_to("/dev/zero")
    assert "a character device, not a regular file (a symlink to '/dev/zero')" in file_problem(tmp_path / "zero").cause
    assert describe_os_error(PermissionError(13, "Permission denied")) == "permission denied (EACCES)"


def test_a_denied_file_is_a_data_error_exit_2(tmp_path) -> None:  # noqa: ANN001
    """The choice of class, seen without changing user: EACCES is exit 2, other faults exit 3."""
    from attnlab.reading import FileProblem

    denied = FileProblem(str(tmp_path / "x"), "permission denied (EACCES)", denied=True).error()
    assert isinstance(denied, DataError) and denied.exit_code == 2 and not isinstance(denied, CheckpointError)


def test_json_files_of_a_folder_are_read_within_the_cap(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    from attnlab.pretrained import checkpoint

    big = tmp_path / "config.json"
    big.write_text('{"model_type": "llama", "x": "' + "y" * 2000 + '"}')
    monkeypatch.setattr(checkpoint, "read_capped", lambda path: read_capped(path, cap=1000))
    with pytest.raises(CheckpointError, match=r"config.json: more than .* bytes"):
        read_json(big)


def test_a_symlink_loop_named_as_the_model_is_named(tmp_path) -> None:  # noqa: ANN001
    (tmp_path / "model").symlink_to("model")
    with pytest.raises(UsageError, match="model: a symlink loop"):
        find_checkpoint(tmp_path / "model")


def test_a_folder_with_an_unreadable_config_is_still_a_model_folder(tiny, tmp_path) -> None:  # noqa: ANN001
    """A FIFO config.json beside a tokenizer_config.json: the model folder's damage, not "no such run"."""
    folder = Path(shutil.copytree(tiny, tmp_path / "model"))
    (folder / "config.json").unlink()
    os.mkfifo(folder / "config.json")
    assert is_checkpoint_folder(folder)


def test_a_damaged_tokenizer_json_is_damaged_file_error(tmp_path) -> None:  # noqa: ANN001
    """Exit 3 (and still a DataError, a ValueError, for callers that catch those); a tokenizer that
    cannot be read at all is a DataError naming the errno."""
    path = tmp_path / "tokenizer.json"
    path.write_bytes(b'{"version": "1.0", "model": ')
    with pytest.raises(DamagedFileError, match="tokenizer.json:1: not valid JSON") as caught:
        Tokenizer.load(path)
    assert caught.value.exit_code == 3 and isinstance(caught.value, DataError)
    path.write_bytes(b"\xff\xfe{}")
    with pytest.raises(DamagedFileError, match="bytes that are not UTF-8"):
        Tokenizer.load(path)
    with pytest.raises(DataError, match=r"nothing.json: cannot read: missing \(no such file\) \(ENOENT\)"):
        Tokenizer.load(tmp_path / "nothing.json")


def test_a_tokenizer_json_named_by_a_flag_is_damaged_exit_3(tmp_path, capsys) -> None:  # noqa: ANN001
    """``tokenize --tokenizer FILE`` with bytes that are not UTF-8: exit 3, as in a model folder."""
    from attnlab.cli import main

    path = tmp_path / "binary.txt"
    path.write_bytes(b"fine\nnot \xff utf8\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["tokenize", "--tokenizer", str(path), "x"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 3 and err.startswith("error: ") and "binary.txt:2: bytes that are not UTF-8" in err
