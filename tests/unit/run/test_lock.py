"""RunLock: one writer per run directory, held by a real OS lock that dies with its process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from attnlab.errors import UsageError
from attnlab.run.directory import RunDir
from attnlab.run.lock import LOCK_NAME, RunLock

HOLDER = textwrap.dedent(
    """
    import sys, time
    from attnlab.run.lock import RunLock
    with RunLock(sys.argv[1]):
        print("locked", flush=True)
        time.sleep(120)
    """
)


def test_a_second_writer_is_refused_until_the_holder_is_killed_with_sigkill(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    RunDir(run).write_config({"task": {"name": "copy"}})  # as a run's files exist while it trains
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        refused = rf"being written by another process \(PID {holder.pid} on host \S+ since 20"
        with pytest.raises(UsageError, match=refused):
            RunLock(run).acquire()
        assert UsageError.exit_code == 2
        # readers never take the lock: they read on while it is held
        assert RunDir.open(run).read_config() == {"task": {"name": "copy"}}
        assert RunDir.open(run).read_metrics() == []
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait()
    assert json.loads((run / LOCK_NAME).read_text())["pid"] == holder.pid  # left behind by kill -9: means nothing
    with RunLock(run) as lock:
        assert lock.held
        assert json.loads((run / LOCK_NAME).read_text())["pid"] == os.getpid()


def test_release_lets_the_next_writer_in_and_clears_the_record(tmp_path):
    with RunLock(tmp_path) as first:
        assert first.held
        with pytest.raises(UsageError, match=f"PID {os.getpid()} "):  # a second open file of the same process too
            RunLock(tmp_path).acquire()
    assert not first.held
    assert (tmp_path / LOCK_NAME).read_text() == ""
    with RunLock(tmp_path):
        pass


def test_a_disabled_lock_takes_nothing(tmp_path):
    with RunLock(tmp_path, enabled=False) as lock, RunLock(tmp_path):
        assert not lock.held


def test_a_directory_holding_only_the_lock_counts_as_empty(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / LOCK_NAME).write_text("")
    RunDir.create(tmp_path / "run")
    (tmp_path / "run" / "config.json").write_text("{}")
    with pytest.raises(UsageError, match="already exists and is not empty"):
        RunDir.create(tmp_path / "run")


def test_an_unreadable_holder_record_still_gives_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setattr("attnlab.run.lock._HOLDER_WAIT_S", 0.05)
    with RunLock(tmp_path):
        (tmp_path / LOCK_NAME).write_text("[" * 100_000)
        with pytest.raises(UsageError, match="its PID is not recorded"):
            RunLock(tmp_path).acquire()


def test_a_missing_directory_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="cannot lock"):
        RunLock(tmp_path / "absent").acquire()


def test_import_bert_into_a_locked_run_is_refused(tmp_path):
    from attnlab.pretrained.bert import find_source, import_bert
    from tests.unit.pretrained.tiny_bert import write_tiny_bert

    source = find_source(write_tiny_bert(tmp_path / "src"))
    (tmp_path / "run").mkdir()
    with RunLock(tmp_path / "run"), pytest.raises(UsageError, match=f"PID {os.getpid()} "):
        import_bert(source, tmp_path / "run")
    assert {p.name for p in (tmp_path / "run").iterdir()} == {LOCK_NAME}  # nothing written
    import_bert(source, tmp_path / "run")  # the directory holding only .lock counts as empty


def test_writing_a_pruned_run_into_a_locked_directory_is_refused(tmp_path):
    from attnlab.analysis.pruning import write_pruned_run
    from attnlab.experiment import ExperimentConfig, model_for_task
    from attnlab.run.loaded import LoadedRun, open_run
    from attnlab.tasks.codec import TextCodec
    from attnlab.tasks.registry import build_task

    experiment = ExperimentConfig.from_dict(
        {
            "task": {"name": "copy"},
            "model": {"kind": "encoder_decoder", "layers": 1, "d_model": 8, "heads": 2, "d_ff": 8},
        }
    )
    task, _ = build_task(experiment.task)
    model = model_for_task(experiment, task)
    loaded = LoadedRun(RunDir(tmp_path / "source"), experiment, task, None, TextCodec(task, None), model)
    (tmp_path / "pruned").mkdir()
    with RunLock(tmp_path / "pruned"), pytest.raises(UsageError, match=f"PID {os.getpid()} "):
        write_pruned_run(loaded, model, tmp_path / "pruned", pruned=[])
    assert not (tmp_path / "pruned" / RunDir.CONFIG).exists()
    write_pruned_run(loaded, model, tmp_path / "pruned", pruned=[])
    assert open_run(tmp_path / "pruned").experiment == experiment
