"""Nothing half-written: a folder of outputs or an imported run appears whole or not at all
(:func:`attnlab.run.storage.atomic_directory`, :meth:`attnlab.run.directory.RunDir.staged`); a full
disk, a file-size limit or a refused place is one ``error:`` line naming the file and the errno
(exit 4 for no room, 2 for a refusal); ``attnlab verify`` fails a run without weights or with a
file its manifest does not list. The full disk is a ``RLIMIT_FSIZE`` limit in the CLI's process
(SIGXFSZ ignored, so a write past it fails with EFBIG), which needs neither root nor a tmpfs."""

from __future__ import annotations

import errno
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from attnlab.errors import EXIT_RESOURCES, EXIT_USAGE, ResourceError, UsageError
from attnlab.run import manifest as manifests
from attnlab.run.directory import RunDir
from attnlab.run.storage import atomic_directory, atomic_write_text, write_error
from attnlab.run.verification import verify_run
from tests.unit.analysis.tiny_lm import tiny_lm_run

ROOT = os.geteuid() == 0


def _entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ---- atomic_directory -------------------------------------------------------------------------


def test_a_new_folder_appears_whole_with_the_folders_above_it(tmp_path):
    target = tmp_path / "a" / "b" / "out"
    with atomic_directory(target) as staging:
        atomic_write_text(staging / "x.csv", "x")
        assert not (tmp_path / "a").exists()  # nothing visible under the name asked for yet
        assert [p.name.startswith(".a.tmp-") for p in tmp_path.iterdir()] == [True]
    assert _entries(tmp_path) == ["a"]
    assert (target / "x.csv").read_text() == "x"
    assert oct(target.stat().st_mode & 0o777) == oct(0o777 & ~_umask())  # a plain mkdir's, not mkdtemp's 0700


def test_a_failure_leaves_nothing_and_no_temporary_folder(tmp_path):
    with pytest.raises(RuntimeError), atomic_directory(tmp_path / "out") as staging:
        atomic_write_text(staging / "x.csv", "x")
        raise RuntimeError("stop")
    assert _entries(tmp_path) == []


def test_a_rerun_replaces_its_files_keeps_the_others_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "analysis"
    target.mkdir()
    (target / "other.csv").write_text("kept")
    (target / "x.csv").write_text("old")
    with atomic_directory(target) as staging:
        atomic_write_text(staging / "x.csv", "new")
        atomic_write_text(staging / "sub" / "y.csv", "y")
        assert (target / "x.csv").read_text() == "old"
    assert _entries(target) == ["other.csv", "sub", "x.csv"]
    assert (target / "x.csv").read_text() == "new"
    assert (target / "sub" / "y.csv").read_text() == "y"


def test_an_error_names_the_file_at_its_place_not_in_the_temporary_folder(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(UsageError) as caught, atomic_directory(tmp_path / "out") as staging:
        atomic_write_text(staging / "x.csv", "x")
        atomic_write_text(staging / "x.csv" / "y.csv", "y")  # below a file
    placed = tmp_path / "out" / "x.csv"
    assert str(caught.value) == f"{placed}: cannot create the folder: {placed} is a file"
    assert _entries(tmp_path / "out") == []


@pytest.mark.parametrize(
    ("code", "kind", "exit_code"),
    [
        (errno.ENOSPC, ResourceError, EXIT_RESOURCES),
        (errno.EDQUOT, ResourceError, EXIT_RESOURCES),
        (errno.EFBIG, ResourceError, EXIT_RESOURCES),
        (errno.EACCES, UsageError, EXIT_USAGE),
        (errno.EROFS, UsageError, EXIT_USAGE),
        (errno.EIO, UsageError, EXIT_USAGE),
    ],
)
def test_write_errors_name_the_path_and_the_errno(tmp_path, code, kind, exit_code):
    error = write_error(tmp_path / "f", OSError(code, os.strerror(code)))
    assert type(error) is kind and error.exit_code == exit_code
    assert str(error).startswith(f"{tmp_path / 'f'}: cannot write: {os.strerror(code)} ({errno.errorcode[code]})")


def test_a_folder_that_cannot_be_made_is_one_error_naming_it(tmp_path, monkeypatch):
    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(os, "mkdir", read_only)
    with pytest.raises(UsageError, match=rf"{tmp_path / 'out'}: cannot create the folder: .*\(EROFS\)"):
        with atomic_directory(tmp_path / "out"):
            pass


@pytest.mark.skipif(ROOT, reason="root writes into a read-only folder")
def test_a_read_only_parent_is_one_usage_error_naming_the_path(tmp_path):
    parent = tmp_path / "locked"
    parent.mkdir()
    parent.chmod(0o500)
    try:
        with pytest.raises(UsageError, match=rf"{parent / 'out'}: cannot create the folder: .*\(EACCES\)"):
            with atomic_directory(parent / "out"):
                pass
        result = _attnlab("heads", "detect", str(_lm_run(tmp_path)), "--out", str(parent / "out"))
        assert result.returncode == EXIT_USAGE, result.stderr
        assert _error_lines(result) and str(parent) in _error_lines(result)[0]
    finally:
        parent.chmod(0o700)


def test_safetensors_write_errors_are_named_with_their_errno(tmp_path):
    path = tmp_path / "w.safetensors"
    script = (
        "import sys, torch\n"
        "from attnlab.errors import ResourceError\n"
        "from attnlab.run.storage import stream_tensors\n"
        "try:\n"
        f"    stream_tensors({str(path)!r}, {{'a': torch.zeros(4096)}})\n"
        "except ResourceError as error:\n"
        "    print(error)\n"
        "    sys.exit(4)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, preexec_fn=_limited(1024)
    )
    assert result.returncode == 4, result.stderr
    assert result.stdout.startswith(f"{path}: cannot write: File too large (EFBIG)")
    assert _entries(tmp_path) == []  # no temporary file left


# ---- runs -------------------------------------------------------------------------------------


def test_a_staged_run_appears_whole_and_a_failed_one_leaves_nothing(tmp_path):
    target = tmp_path / "run"
    with RunDir.staged(target) as run:
        run.write_config({"a": 1})
        assert not target.exists() and run.path != target
    assert run.path == target and (target / "config.json").is_file()
    with pytest.raises(RuntimeError), RunDir.staged(tmp_path / "other") as run:
        run.write_config({"a": 1})
        raise RuntimeError("stop")
    assert _entries(tmp_path) == ["run"]


def test_a_staged_run_does_not_take_the_place_of_one_that_appeared_meanwhile(tmp_path):
    target = tmp_path / "run"
    with pytest.raises(UsageError, match="already exists and is not empty"), RunDir.staged(target) as run:
        run.write_config({"a": 1})
        target.mkdir()
        (target / "config.json").write_text("theirs")
    assert _entries(target) == ["config.json"] and (target / "config.json").read_text() == "theirs"


def test_a_staged_run_over_an_old_one_replaces_its_files_but_not_its_lock(tmp_path):
    target = tmp_path / "run"
    with RunDir.staged(target) as run:
        run.write_config({"a": 1})
    lock = (target / RunDir.LOCK).stat().st_ino
    with RunDir.staged(target, overwrite=True) as run:
        run.write_config({"a": 2})
    assert (target / RunDir.LOCK).stat().st_ino == lock
    assert RunDir.open(target).read_config() == {"a": 2}
    assert not [p for p in target.iterdir() if ".tmp-" in p.name]


def test_verify_fails_a_run_without_weights(tmp_path):
    run = _lm_run(tmp_path)
    (run / "model.safetensors").unlink()
    assert _problems(run) == {"model.safetensors": "weights not found"}  # listed in the manifest
    manifest = manifests.read_manifest(run)
    manifests.write_manifest(run, manifest.without({"model.safetensors"}))  # what a failed import left
    assert _problems(run) == {"model.safetensors": "weights not found"}
    result = _attnlab("verify", str(run))
    assert result.returncode == 3
    assert str(run / "model.safetensors") in result.stdout + result.stderr


@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json", "config.json"])
def test_verify_fails_a_file_its_manifest_does_not_list(tmp_path, name):
    run = _lm_run(tmp_path)
    manifests.write_manifest(run, manifests.read_manifest(run).without({name}))
    assert _problems(run) == {name: "not listed"}


# ---- the command line, under a file-size limit ------------------------------------------------


def test_import_hf_past_a_file_size_limit_leaves_nothing_and_names_the_weights(tmp_path):
    from tests.unit.pretrained.tiny_hf import build

    source = tmp_path / "hf"
    source.mkdir()
    build("llama", source)
    weights = (source / "model.safetensors").stat().st_size
    out = tmp_path / "runs" / "imported"
    (tmp_path / "runs").mkdir()
    result = _attnlab("import", "hf", str(source), "--out", str(out), limit=weights // 2)
    assert result.returncode == EXIT_RESOURCES, result.stderr
    lines = _error_lines(result)
    assert len(lines) == 1 and f"{out / 'model.safetensors'}: cannot write: File too large (EFBIG)" in lines[0]
    assert _entries(tmp_path / "runs") == []  # no run, no temporary sibling


def test_detect_past_a_file_size_limit_leaves_no_folder(tmp_path):
    run = _lm_run(tmp_path)
    out = tmp_path / "detect"
    result = _attnlab("heads", "detect", str(run), "--length", "8", "--out", str(out), limit=4096)
    assert result.returncode == EXIT_RESOURCES, result.stderr
    lines = _error_lines(result)
    assert len(lines) == 1 and str(out) in lines[0] and "(EFBIG)" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lm"]  # no folder, empty or not


# ---- helpers ----------------------------------------------------------------------------------


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _lm_run(tmp_path: Path) -> Path:
    run, _texts = tiny_lm_run(tmp_path / "lm")
    return Path(run)


def _problems(run: Path) -> dict[str, str]:
    """Each damaged file of ``run`` -> the first of the phrases expected in its message that it holds."""
    phrases = ("weights not found", "not listed", "not found")
    report = verify_run(run)
    return {check.path: next((p for p in phrases if p in check.detail), check.detail) for check in report.problems}


def _limited(limit: int):  # noqa: ANN202
    """A preexec function: files of at most ``limit`` bytes, a write past it failing with EFBIG."""

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def _attnlab(*args: str, limit: int | None = None) -> subprocess.CompletedProcess[str]:
    """``attnlab ARGS`` in a fresh process, with files capped at ``limit`` bytes when given."""
    return subprocess.run(
        [sys.executable, "-m", "attnlab", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"},
        preexec_fn=_limited(limit) if limit is not None else None,
    )


def _error_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith(("error:", "internal error"))]
