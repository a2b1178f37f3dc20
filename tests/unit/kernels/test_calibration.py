"""attnlab.kernels.calibration: a shape class is measured once, remembered in memory and on disk
under the machine's key, re-measured when the key differs or the file is corrupt, and never while
timing must not run."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from attnlab.kernels import calibration


@pytest.fixture
def timings(monkeypatch, tmp_path):
    """Calibration on, an empty cache in ``tmp_path``, and ``measure`` replaced by a stub that
    records each call and picks the last candidate (the real timing is tested on its own)."""
    monkeypatch.setattr(calibration, "MEASURING", True)
    monkeypatch.setenv("ATTNLAB_CALIBRATION_DIR", str(tmp_path))
    calibration.forget()
    monkeypatch.setattr(calibration, "machine_busy", lambda: False)  # a quiet machine, whatever runs beside the tests
    calls = []
    monkeypatch.setattr(
        calibration, "measure", lambda candidates, tie=None: calls.append(list(candidates)) or list(candidates)[-1]
    )
    yield calls
    calibration.forget()


CANDIDATES = {"a": lambda: None, "b": lambda: None}
KEY = ("job", torch.float32, True, 8, 64)


def test_bucket_rounds_up_to_powers_of_two():
    assert [calibration.bucket(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 256, 257)] == [0, 1, 2, 4, 4, 8, 8, 16, 256, 512]


def test_a_class_is_measured_once_then_read_back_from_disk(timings):
    assert calibration.choose(KEY, CANDIDATES) == "b" and len(timings) == 1
    assert calibration.chosen(KEY) == "b"
    assert calibration.choose(KEY, CANDIDATES) == "b" and len(timings) == 1  # memory
    calibration.forget()
    assert calibration.chosen(KEY) is None
    assert calibration.choose(KEY, CANDIDATES) == "b" and len(timings) == 1  # the disk cache
    data = json.loads(calibration.cache_path().read_text())
    assert data["choices"] == {"job|torch.float32|True|8|64": "b"}
    assert [p.name for p in calibration.cache_path().parent.iterdir()] == [
        calibration.cache_path().name
    ]  # no temp file


def test_another_machine_key_measures_again(timings, monkeypatch):
    calibration.choose(KEY, CANDIDATES)
    calibration.forget()
    monkeypatch.setattr(calibration, "_machine_key", lambda: "another-build")
    calibration.choose(KEY, CANDIDATES)
    assert len(timings) == 2 and calibration.cache_path().name == "another-build.json"


@pytest.mark.parametrize("text", ["{not json", '{"version": 1, "choices": [1]}', '{"version": 99, "choices": {}}', ""])
def test_a_corrupt_cache_file_is_measured_again_and_rewritten(timings, text):
    path = calibration.cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    assert calibration.choose(KEY, CANDIDATES) == "b" and len(timings) == 1
    assert json.loads(path.read_text())["choices"] == {"job|torch.float32|True|8|64": "b"}


def test_a_stored_name_that_is_no_candidate_now_is_measured_again(timings):
    calibration.choose(KEY, {"a": lambda: None, "gone": lambda: None})
    calibration.forget()
    assert calibration.choose(KEY, CANDIDATES) == "b" and len(timings) == 2


def test_a_class_timed_on_a_busy_machine_is_used_but_not_written_to_disk(timings, monkeypatch):
    monkeypatch.setattr(calibration, "machine_busy", lambda: True)
    assert calibration.choose(KEY, CANDIDATES) == "b" and calibration.chosen(KEY) == "b"
    assert not calibration.cache_path().exists()
    calibration.forget()
    monkeypatch.setattr(calibration, "machine_busy", lambda: False)
    assert calibration.choose(KEY, CANDIDATES) == "b" and len(timings) == 2  # timed again, now remembered
    assert calibration.cache_path().exists()


@pytest.mark.parametrize("load,busy", [(0.5, False), (2.0, False), (2.5, True)])
def test_the_machine_is_busy_when_the_load_exceeds_its_cores(monkeypatch, load, busy):
    monkeypatch.setattr(calibration.os, "getloadavg", lambda: (load, 0.0, 0.0))
    monkeypatch.setattr(calibration.os, "sched_getaffinity", lambda pid: {0, 1})
    assert calibration.machine_busy() is busy


def test_an_unwritable_cache_keeps_the_answer_in_memory(timings, monkeypatch, tmp_path):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("ATTNLAB_CALIBRATION_DIR", str(tmp_path / "file" / "below"))  # a folder inside a file
    assert calibration.choose(KEY, CANDIDATES) == "b" and calibration.chosen(KEY) == "b"


def test_nothing_is_measured_or_remembered_where_timing_must_not_run(timings, monkeypatch):
    """One candidate; a dispatch mode (FlopCounterMode); ATTNLAB_CALIBRATE=0: the first candidate."""
    assert calibration.choose(KEY, {"a": lambda: None}) == "a"
    with FlopCounterMode(display=False):
        assert calibration.choose(KEY, CANDIDATES) == "a"
    monkeypatch.setattr(calibration, "MEASURING", False)
    assert calibration.choose(KEY, CANDIDATES) == "a"
    assert not timings and calibration.chosen(KEY) is None and not calibration.cache_path().exists()


def test_measure_picks_the_fastest_and_ties_go_to_the_first():
    import time

    calls = []
    fast, slow = (lambda: calls.append("fast")), (lambda: calls.append("slow") or time.sleep(0.002))
    assert calibration.measure({"slow": slow, "fast": fast}) == "fast"
    assert calls.count("fast") == calls.count("slow") >= 2  # a warm-up call and rounds, interleaved
    assert calibration.measure({"x": lambda: None, "y": lambda: None}) in {"x", "y"}


@pytest.mark.parametrize(
    ("seconds", "winner"),
    [
        ({"first": 1.00, "second": 0.97}, "first"),  # 3% faster: within TIE, the caller's order holds
        ({"first": 1.00, "second": 0.90}, "second"),  # 10% faster: the timing decides
        ({"first": 0.90, "second": 1.00}, "first"),
        ({"first": 1.00, "second": 0.99, "third": 0.50}, "third"),
    ],
)
def test_an_earlier_candidate_within_tie_of_the_fastest_wins(monkeypatch, seconds, winner):
    """Each call advances a fake clock by its candidate's time: the rule, not the machine, decides."""
    clock = [0.0]
    monkeypatch.setattr(calibration.time, "perf_counter", lambda: clock[0])

    def call(name):  # noqa: ANN001, ANN202
        return lambda: clock.__setitem__(0, clock[0] + seconds[name] * 1e-3)

    assert calibration.TIE == 0.05
    assert calibration.measure({name: call(name) for name in seconds}) == winner


def test_the_private_cache_size_is_read_from_the_system_or_defaults_to_a_mebibyte():
    size = calibration.cache_bytes()
    assert isinstance(size, int) and 64 * 1024 <= size <= 1 << 30


def test_the_thread_count_is_part_of_the_cache_key(timings, monkeypatch):
    calibration.choose(KEY, CANDIDATES)
    first = calibration.cache_path()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    assert calibration.cache_path() != first
    calibration.CHOICES.clear()  # this process's answers stay; a file for 97 threads has none
    calibration.choose(KEY, CANDIDATES)
    assert len(timings) == 2
