"""Training is bit-reproducible by default: the kernels a run uses are chosen without timing
(``[runtime] kernels = "fixed"``), recorded in the run (kernels.json, in its manifest), and read back
by whoever resumes, evaluates, loads or trains ``--like`` it (attnlab.kernels.calibration.KernelRecord)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from attnlab.errors import ConfigError, UsageError
from attnlab.experiment import ExperimentConfig
from attnlab.kernels import calibration
from attnlab.kernels.calibration import KernelRecord
from attnlab.run.directory import RunDir
from attnlab.run.loaded import open_run
from attnlab.run.verification import verify_run
from attnlab.training.trainer import train

CONFIG = {
    "task": {"name": "parity", "max_train_length": 8, "train_size": 128, "valid_size": 32, "test_size": 32},
    "model": {"kind": "encoder_classifier", "layers": 1, "d_model": 16, "heads": 2, "d_ff": 32, "dropout": 0.0},
    "train": {"steps": 8, "batch_size": 16, "lr": 3e-3, "warmup": 2, "eval_every": 4, "checkpoint_every": 4},
}


def _experiment(**runtime: str) -> ExperimentConfig:
    return ExperimentConfig.from_dict({**CONFIG, "runtime": runtime})


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _kernels(run: Path) -> dict:
    return json.loads((run / "kernels.json").read_text())


@pytest.fixture
def measuring(monkeypatch, tmp_path):
    """Timing allowed (the test suite turns it off), with an empty machine cache of this test's own."""
    cache = tmp_path / "calibration"
    monkeypatch.setattr(calibration, "MEASURING", True)
    monkeypatch.setenv("ATTNLAB_CALIBRATION_DIR", str(cache))
    calibration.forget()
    yield cache
    calibration.forget()


def _train_in_a_process(config: Path, out: Path, calibration_dir: Path) -> None:
    """``attnlab train CONFIG --out OUT`` in its own process, as a researcher reruns a config, with
    timing allowed (the tests' processes turn it off) and the machine cache in ``calibration_dir``."""
    env = {**os.environ, "ATTNLAB_CALIBRATE": "1", "ATTNLAB_CALIBRATION_DIR": str(calibration_dir)}
    command = [sys.executable, "-m", "attnlab", "train", str(config), "--out", str(out), "--no-progress"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]


def test_two_runs_give_the_same_weights_with_the_cache_emptied_and_the_machine_loaded(tmp_path):
    config = tmp_path / "parity.toml"
    config.write_text(
        "\n".join(
            f"[{section}]\n" + "\n".join(f"{key} = {json.dumps(value)}" for key, value in table.items())
            for section, table in CONFIG.items()
        )
    )
    cache = tmp_path / "calibration"
    _train_in_a_process(config, tmp_path / "a", cache)
    shutil.rmtree(cache, ignore_errors=True)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # a CPU-bound neighbour
    try:
        _train_in_a_process(config, tmp_path / "b", cache)
    finally:
        busy.kill()
        busy.wait()
    assert _sha256(tmp_path / "a" / "model.safetensors") == _sha256(tmp_path / "b" / "model.safetensors")
    first, second = _kernels(tmp_path / "a"), _kernels(tmp_path / "b")
    assert first["mode"] == "fixed" and first["choices"] == second["choices"]
    assert any(entry.startswith("attention|") for entry in first["choices"])  # the record was consulted
    assert {"cpu", "torch", "threads"} <= set(first["machine"])
    assert verify_run(tmp_path / "a").ok


def test_fixed_kernels_are_never_timed_and_measured_ones_are(tmp_path, measuring, monkeypatch):
    timed: list[list[str]] = []
    real = calibration.measure
    monkeypatch.setattr(
        calibration, "measure", lambda candidates, tie=None: timed.append(list(candidates)) or real(candidates, tie=tie)
    )
    monkeypatch.setattr(calibration, "machine_busy", lambda: False)
    train(_experiment(), tmp_path / "fixed", progress=False)
    assert timed == []
    calibration.forget()
    train(_experiment(kernels="measured"), tmp_path / "measured", progress=False)
    assert timed  # the same classes, now timed
    record = _kernels(tmp_path / "measured")
    assert record["mode"] == "measured" and set(record["choices"]) == set(_kernels(tmp_path / "fixed")["choices"])


def test_resume_like_and_loading_use_the_recorded_choices(tmp_path):
    train(_experiment(), tmp_path / "a", progress=False)
    run = RunDir.open(tmp_path / "a")
    recorded = run.read_kernels()
    assert recorded is not None and recorded.mode == "fixed"
    attention = [entry for entry in recorded.choices if entry.startswith("attention|")]
    changed = {**recorded.choices, **{entry: "explicit" for entry in attention}}
    with run.lock():
        run.write_kernels(KernelRecord("measured", changed))  # as a measured run on another machine might have
    assert verify_run(tmp_path / "a").ok
    loaded = open_run(tmp_path / "a")
    assert loaded.model.kernel_record.mode == "measured" and loaded.model.kernel_record.choices == changed
    train(_experiment(), tmp_path / "c", progress=False, like=tmp_path / "a")
    repeated = _kernels(tmp_path / "c")
    assert repeated["mode"] == "measured" and all(repeated["choices"][entry] == "explicit" for entry in attention)
    longer = ExperimentConfig.from_dict({**CONFIG, "train": {**CONFIG["train"], "steps": 12}})
    train(longer, tmp_path / "c", resume=True, progress=False)
    assert all(_kernels(tmp_path / "c")["choices"][entry] == "explicit" for entry in attention)


def test_bad_runtime_settings_and_like_are_one_clear_error(tmp_path):
    with pytest.raises(ConfigError, match=r"runtime.attention: unknown 'flash'; allowed: auto, "):
        _experiment(attention="flash")
    with pytest.raises(ConfigError, match=r"runtime.kernels: unknown 'fast'; allowed: fixed, measured"):
        _experiment(kernels="fast")
    with pytest.raises(ConfigError, match=r"runtime.threads: unknown key; allowed: attention, kernels"):
        ExperimentConfig.from_dict({**CONFIG, "runtime": {"threads": 2}})
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text(json.dumps(_experiment().to_dict()))
    with pytest.raises(UsageError, match=r"--like: .*old records no kernel choices"):
        train(_experiment(), tmp_path / "new", progress=False, like=tmp_path / "old")
    assert not (tmp_path / "new").exists()
