"""attnlab.devices: the names auto, cpu, cuda and cuda:N, what each means on a machine with and
without GPUs (torch.cuda's answers stubbed), and the device of a model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnlab.devices import check_device_name, check_processes, model_device, resolve_device
from attnlab.errors import ConfigError
from attnlab.training.trainer import resolve_device as resolve_train_device


def _gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize("name", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_well_formed_names_pass(name):
    assert check_device_name(name) == name


@pytest.mark.parametrize("name", ["tpu", "cuda:x", "cuda:", "CPU", "cuda:-1", " cpu", "", "mps"])
def test_malformed_names_are_refused_with_the_allowed_ones(name):
    with pytest.raises(ValueError, match=r"unknown device .*; allowed: auto, cpu, cuda, cuda:N"):
        check_device_name(name)


def test_without_a_gpu_auto_is_the_cpu_and_cuda_is_refused(monkeypatch):
    _gpus(monkeypatch, 0)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    for name in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match="no CUDA device is visible; use cpu or auto"):
            resolve_device(name)


def test_with_gpus_auto_takes_the_gpu_and_an_index_must_exist(monkeypatch):
    _gpus(monkeypatch, 2)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"'cuda:2' asked for, but this process sees 2 CUDA device\(s\)"):
        resolve_device("cuda:2")


def test_train_device_errors_name_the_config_key(monkeypatch):
    _gpus(monkeypatch, 0)
    with pytest.raises(ConfigError, match="train.device: 'cuda' asked for, but no CUDA device is visible"):
        resolve_train_device("cuda")


@pytest.mark.parametrize(
    ("gpus", "device", "processes", "error"),
    [
        (0, "cpu", 4, None),
        (0, "cpu", 5, r"5 processes on the cpu, but this process may use 4 cores; use --nproc 4 or fewer"),
        (2, "cuda", 2, None),
        (2, "cuda", 1, None),
        (0, "cuda", 1, None),  # one process: resolve_device's own check applies
        (1, "cuda", 2, r"2 processes on cuda need one GPU each, but this process sees 1; use --nproc 1 or fewer"),
        (0, "cuda", 2, r"2 processes on cuda need one GPU each, but this process sees 0; use the cpu"),
        (4, "cuda:1", 2, r"'cuda:1' names one GPU, but each of the 2 processes takes its own \(cuda:0 to cuda:1\)"),
    ],
)
def test_processes_need_one_core_or_gpu_each(monkeypatch, gpus, device, processes, error):
    _gpus(monkeypatch, gpus)
    monkeypatch.setattr("attnlab.devices.cpu_cores", lambda: 4)
    if error is None:
        check_processes(device, processes)
    else:
        with pytest.raises(ValueError, match=error):
            check_processes(device, processes)


def test_model_device_is_the_first_parameters_and_cpu_without_any():
    assert model_device(nn.Linear(2, 2)) == torch.device("cpu")
    assert model_device(nn.ReLU()) == torch.device("cpu")
    meta = nn.Linear(2, 2, device="meta")
    assert model_device(meta) == torch.device("meta")
