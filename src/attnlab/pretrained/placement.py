"""Placing a model over devices: which layer on which device (a GPU, the CPU, the disk), planned
before anything is read.

A request (:class:`PlacementRequest`) follows accelerate's conventions, as transformers'
``from_pretrained`` does:

* ``device_map``: ``"auto"`` or ``"balanced"`` (the layers spread evenly over the GPUs, then the
  CPU, then the disk), ``"sequential"`` (each device filled in turn), or ``{prefix: device}`` (a
  module name, ``""`` for the whole model, and ``"cpu"``, ``"cuda:N"`` or ``"disk"``);
* ``max_memory``: ``{device: bytes or "20GiB"}``, the budget of each device (default: what the
  device has free);
* ``offload_folder``: where the layers placed on ``"disk"`` are written, as safetensors;
* ``tokens``, ``cached``: the positions the run keeps in its KV cache and the sites it caches, whose
  bytes are held back from each device's budget (``attnlab generate`` gives its prompt and new
  tokens, ``attnlab patch`` and ``attnlab attention`` their sites too).

:func:`plan` turns a request into a :class:`Placement` with accelerate's planner
(``infer_auto_device_map``, the decoder layers never split), before any weight is read; a plan that
needs the disk without an offload folder is a :class:`~attnlab.errors.ResourceError` (exit 4).
:func:`place` then puts each tensor, as it is assembled, straight on its device: a GPU's copy, the
CPU's (a view of the checkpoint's file where the tensor is used as stored), or for the disk a file
of the offload folder read back as a map of it, so that the operating system pages its layers in
when the forward pass reaches them and out when memory is wanted (no anonymous memory). Each
placed module moves the residual stream it receives to its own device (:func:`dispatch`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.errors import ResourceError, UsageError

__all__ = [
    "DEVICE_MAPS",
    "Placement",
    "PlacementRequest",
    "dispatch",
    "cached_bytes",
    "kv_cache_bytes",
    "offload",
    "plan",
]

DEVICE_MAPS = ("auto", "balanced", "sequential")
"""The planned device maps (accelerate's names); a dict places modules by hand."""


@dataclass(frozen=True)
class PlacementRequest:
    """What the user asked for (see the module docstring); all None: the model on one device."""

    device_map: str | Mapping[str, str] | None = None
    max_memory: Mapping[str, int | str] | None = None
    offload_folder: str | os.PathLike[str] | None = None
    tokens: int = 0
    """Positions the run keeps in its KV cache (a prompt and what is generated): their keys and
    values are held back from every device's budget before the layers are placed."""
    cached: tuple[str, ...] = ()
    """Site names or globs the run caches (``attnlab patch``'s clean run, ``attnlab attention``'s
    patterns), over ``tokens`` positions: their bytes are held back too."""

    def __post_init__(self) -> None:
        if isinstance(self.device_map, str) and self.device_map not in DEVICE_MAPS:
            raise UsageError(f"device_map: unknown {self.device_map!r}; allowed: {', '.join(DEVICE_MAPS)} or a dict")
        if self.device_map is None and (self.max_memory is not None or self.offload_folder is not None):
            raise UsageError("max_memory, offload_folder: only with device_map (auto, balanced, sequential or a dict)")
        for device in {**dict(self.max_memory or {}), **_devices(self.device_map)}:
            _check_device(device)

    @property
    def wanted(self) -> bool:
        return self.device_map is not None


@dataclass(frozen=True)
class Placement:
    """Where each module of a model is.

    Attributes:
        devices: module prefix -> ``cpu``, ``cuda:N`` or ``disk``, the longest prefix deciding.
        sizes: device -> bytes of weights and buffers placed there.
        offload_folder: where the disk's layers are (None: none on disk).
    """

    devices: dict[str, str]
    sizes: dict[str, int]
    offload_folder: Path | None = None

    def unit_of(self, name: str) -> str:
        """The placed module (a key of :attr:`devices`, the longest prefix) that holds parameter or
        module ``name``.

        Raises:
            UsageError: no key covers ``name``.
        """
        best = max((p for p in self.devices if p == "" or name == p or name.startswith(p + ".")), key=len, default=None)
        if best is None:
            raise UsageError(f'device_map: no device for {name!r}; cover every module ("" is the whole model)')
        return best

    def device_of(self, name: str) -> str:
        """The device of parameter or module ``name``."""
        return self.devices[self.unit_of(name)]

    def describe(self) -> str:
        """A few lines for people: each device's modules and bytes."""
        lines = []
        for device in sorted(self.sizes, key=_device_order):
            modules = [prefix or "(the whole model)" for prefix, d in self.devices.items() if d == device]
            shown = ", ".join(_ranges(modules))
            lines.append(f"{device}: {self.sizes[device] / 2**20:,.1f} MiB  {shown}")
        return "\n".join(lines)


def plan(
    model: nn.Module,
    request: PlacementRequest,
    *,
    dtype: torch.dtype | None = None,
    no_split: list[str] | None = None,
) -> Placement:
    """The placement of ``model`` (built, its weights not yet read, or on the meta device) that
    ``request`` asks for; ``no_split``: the module classes kept whole on one device (default: the
    model's layers').

    Raises:
        UsageError: a module prefix the model lacks, a device that is not there.
        ResourceError: layers the budgets leave for the disk without an offload folder.
    """
    from accelerate import infer_auto_device_map  # lazy: only a placed model needs accelerate
    from accelerate.utils import find_tied_parameters, get_balanced_memory

    reserve = kv_cache_bytes(model, request.tokens, dtype) + cached_bytes(model, request.cached, request.tokens, dtype)
    if isinstance(request.device_map, Mapping):
        devices = {prefix: str(device) for prefix, device in request.device_map.items()}
        names = {name for name, _ in model.named_modules()}
        for prefix in devices:
            if prefix not in names:
                raise UsageError(f"device_map: {prefix!r} is no module of this model; e.g. {_examples(model)}")
    else:
        budget = _budget(request.max_memory, reserve)  # None: what each device has free (accelerate's)
        no_split = no_split if no_split is not None else sorted({type(layer).__name__ for layer in _layers(model)})
        gpus = torch.cuda.device_count() > 0 if budget is None else any(k not in ("cpu", "disk") for k in budget)
        if request.device_map != "sequential" and gpus:
            budget = get_balanced_memory(model, max_memory=budget, no_split_module_classes=no_split, dtype=dtype)
        found = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=no_split, dtype=dtype)
        devices = {prefix: f"cuda:{d}" if isinstance(d, int) else str(d) for prefix, d in found.items()}
    placement = Placement(devices, {}, Path(request.offload_folder) if request.offload_folder else None)
    for tied in find_tied_parameters(model):  # one tensor under several names: one device for all
        places = {placement.device_of(name) for name in tied}
        if len(places) > 1:
            raise UsageError(f"device_map: {', '.join(tied)} are one tied tensor; put them on one device, not {places}")
    per_device: dict[str, int] = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        device = placement.device_of(name)
        per_device[device] = per_device.get(device, 0) + tensor.numel() * (dtype or tensor.dtype).itemsize
    if "disk" in per_device and placement.offload_folder is None:
        total, disk = sum(per_device.values()) / 2**20, per_device["disk"] / 2**20
        if isinstance(request.device_map, Mapping):
            raise UsageError(
                f"offload_folder: device_map puts {disk:,.1f} MiB on the disk; give the folder to keep them"
            )
        raise ResourceError(
            f"max_memory: the weights need {total:,.1f} MiB and {disk:,.1f} MiB of them fit no device's budget; "
            "give offload_folder (--offload-folder DIR) to keep those layers on disk, or a larger max_memory"
        )
    return dataclasses.replace(placement, sizes=per_device)


def offload(prefix: str, tensors: dict[str, Tensor], folder: Path) -> dict[str, Tensor]:
    """``tensors`` written to ``folder/PREFIX.safetensors`` (atomically) and read back as maps of
    that file: file-backed pages, paged in when used and out when memory is wanted."""
    from safetensors.torch import save_file

    from attnlab.pretrained.checkpoint import file_views

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{prefix or 'model'}.safetensors"
    temporary = path.with_suffix(".safetensors.tmp")
    save_file(tensors, str(temporary))
    temporary.replace(path)
    return file_views(path)


def dispatch(model: nn.Module, placement: Placement) -> None:
    """Move every buffer to its module's device (the parameters are there already); where a GPU is
    among the devices, give each decoder layer and each module outside the layers that holds
    tensors of its own a pre-hook that moves the tensors it receives to its device (the residual
    stream between devices, however the map nests)."""
    if all(device in ("cpu", "disk") for device in placement.devices.values()):
        return
    for name, module in model.named_modules():
        for key, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[key] = buffer.to(_execution_device(placement.device_of(f"{name}.{key}".lstrip("."))))
    layers = {id(layer) for layer in _layers(model)}
    inside: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in inside:
            continue
        if id(module) in layers:
            inside.update(id(m) for m in module.modules())
        elif not any(True for _ in chain(module.parameters(recurse=False), module.buffers(recurse=False))):
            continue
        device = _execution_device(placement.device_of(name))
        module.register_forward_pre_hook(_mover(device), with_kwargs=True)


def _execution_device(device: str) -> torch.device:
    """Where a module on ``device`` computes (a disk module's maps are read on the CPU)."""
    return torch.device("cpu" if device == "disk" else device)


def _mover(device: torch.device) -> Any:
    def move(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return _moved(args, device), _moved(kwargs, device)

    return move


def _moved(value: Any, device: torch.device) -> Any:
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_moved(v, device) for v in value)
    if isinstance(value, list):
        return [_moved(v, device) for v in value]
    if isinstance(value, dict):
        return {k: _moved(v, device) for k, v in value.items()}
    return value


def _layers(model: nn.Module) -> list[nn.Module]:
    stacks = model.site_stacks() if hasattr(model, "site_stacks") else {}
    return [layer for stack, _ in stacks.values() for layer in stack.layers]


def kv_cache_bytes(model: nn.Module, tokens: int, dtype: torch.dtype | None) -> int:
    """Bytes of the keys and values of ``tokens`` positions over every layer (batch 1): 2 L H_kv d_k
    per position (attnlab's config, or transformers' text config)."""
    if tokens <= 0:
        return 0
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):  # transformers' config
        text = config.get_text_config()
        heads = getattr(text, "num_attention_heads", 1)
        kv = getattr(text, "num_key_value_heads", None) or heads
        width = getattr(text, "head_dim", None) or text.hidden_size // heads
        layers = text.num_hidden_layers
    else:
        layers, kv, width = config.layers, config.key_value_heads, config.d_k or config.d_model // config.heads
    item = (dtype or torch.float32).itemsize
    return 2 * layers * kv * width * tokens * item


def cached_bytes(model: nn.Module, patterns: tuple[str, ...], tokens: int, dtype: torch.dtype | None) -> int:
    """Bytes of the sites matching ``patterns`` over ``tokens`` positions (batch 1), from their
    shapes as the model's config gives them (no forward pass: its weights are not read yet):
    H x T x d for q, k, v, z; H x T x T for scores and pattern; H x T x d_model for result;
    T x d_ff for an FFN's inner sites; T x V for logits; T x d_model for the rest."""
    if not patterns or tokens <= 0 or not hasattr(model, "site_stacks"):
        return 0
    from attnlab.nn.hooks import model_sites, resolve_sites

    config = model.config
    heads, width = config.heads, config.d_k or config.d_model // config.heads
    per_point = {
        "q": heads * width,
        "k": heads * width,
        "v": heads * width,
        "z": heads * width,
        "scores": heads * tokens,
        "pattern": heads * tokens,
        "result": heads * config.d_model,
        "pre": config.d_ff,
        "gate": config.d_ff,
        "up": config.d_ff,
        "hidden": config.d_ff,
        "logits": getattr(config, "vocab_size", config.d_model),
    }
    sites = model_sites(model)
    names: set[str] = set()
    for pattern in patterns:
        try:
            names.update(resolve_sites(sites, [pattern]))
        except ValueError:  # a site this model lacks: the command that caches it says so itself
            continue
    values = sum(per_point.get(sites[name].point, config.d_model) for name in names)
    return values * tokens * (dtype or torch.float32).itemsize


def _budget(max_memory: Mapping[str, int | str] | None, reserve: int = 0) -> dict[Any, int] | None:
    if max_memory is None:
        return None
    from accelerate.utils import convert_file_size_to_int

    budget: dict[Any, int] = {}
    for device, size in max_memory.items():
        try:
            value = convert_file_size_to_int(size) if isinstance(size, str) else int(size)
        except (ValueError, TypeError):
            raise UsageError(f"max_memory[{device!r}]: {size!r} is no size (bytes, or e.g. 20GiB, 500MB)") from None
        key: Any = int(device.split(":")[1]) if device.startswith("cuda:") else device
        if device != "disk" and value <= reserve:
            raise ResourceError(
                f"max_memory[{device!r}]: {value / 2**20:,.1f} MiB cannot hold the run's KV cache and cached "
                f"sites, {reserve / 2**20:,.1f} MiB, besides any layer; give a larger budget or a shorter input"
            )
        budget[key] = value if device == "disk" else value - reserve
    if "disk" not in budget:
        budget["disk"] = 1 << 62  # what no device's budget holds goes to the disk (refused without a folder)
    return budget


def _devices(device_map: Any) -> dict[str, None]:
    return {str(d): None for d in device_map.values()} if isinstance(device_map, Mapping) else {}


def _check_device(device: str) -> None:
    if device in ("cpu", "disk"):
        return
    if not device.startswith("cuda:") or not device[5:].isdigit():
        raise UsageError(f"device_map: unknown device {device!r}; allowed: cpu, disk, cuda:N")
    count = torch.cuda.device_count()
    if int(device[5:]) >= count:
        raise UsageError(f"device_map: {device} is not here ({count} CUDA device{'s' * (count != 1)} visible)")


def _device_order(device: str) -> tuple[int, str]:
    return ({"cpu": 1, "disk": 2}.get(device, 0), device)


def _ranges(modules: list[str]) -> list[str]:
    """``decoder.layers.0`` .. ``decoder.layers.5`` as ``decoder.layers.0-5``."""
    shown: list[str] = []
    for name in modules:
        stem, _, index = name.rpartition(".")
        if shown and index.isdigit():
            last = shown[-1]
            last_stem, _, last_range = last.rpartition(".")
            start, _, end = last_range.partition("-")
            if last_stem == stem and (end or start).isdigit() and int(end or start) + 1 == int(index):
                shown[-1] = f"{stem}.{start}-{index}"
                continue
        shown.append(name)
    return shown


def _examples(model: nn.Module) -> str:
    return ", ".join(repr(name) for name, _ in list(model.named_modules())[1:4])
