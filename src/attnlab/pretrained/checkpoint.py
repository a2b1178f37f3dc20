"""A Hugging Face checkpoint on this disk: where it is, and its tensors read without a copy on disk.

A model folder in Hugging Face's layout holds ``config.json`` (the architecture, with its
``model_type``), the weights as ``model.safetensors`` or as shards ``model-0000N-of-0000M.safetensors``
listed by ``model.safetensors.index.json``, and the tokenizer (``tokenizer.json``, with
``tokenizer_config.json`` and ``generation_config.json`` for the special tokens and the chat
template). Such folders sit where a user saved them, or in the Hugging Face cache under
``models--ORG--NAME/snapshots/REVISION/``; :func:`find_checkpoint` takes either, and never
downloads anything.

The weights are read with ``safetensors`` (never pickle) one tensor at a time, in their stored
dtype, from memory-mapped files (:func:`read_tensors`). Every structural fault (a shard the index
names that is missing, a tensor listed in the index but not in its shard, a header that does not
parse, a file shorter than its header says) is a :class:`attnlab.errors.CheckpointError` naming the
file, before any tensor is used.

Every file of the folder is looked at before it is opened (:func:`attnlab.reading.file_problem`):
a file that is missing, a broken symlink, a symlink loop, a FIFO, a device or a folder in a
file's place is named for what it is (exit 3: the folder is damaged); a file this user may not read
is "permission denied" (exit 2: a file the system refuses). A FIFO is never opened and ``/dev/zero``
never mapped. JSON files are read through :func:`attnlab.reading.read_capped` (at most
:data:`attnlab.limits.MAX_INPUT_BYTES`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from attnlab.errors import AttnlabError, CheckpointError, DataError, UsageError
from attnlab.limits import MAX_INPUT_BYTES
from attnlab.reading import describe_os_error, file_problem, read_capped

__all__ = [
    "Checkpoint",
    "find_checkpoint",
    "hub_cache",
    "read_tensors",
    "StoredTensor",
    "read_json",
    "is_checkpoint_folder",
    "storage_dtype",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
"""The files of a model folder beside its config and weights that attnlab reads."""
MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
"""A model name as the Hub spells it: ``NAME`` or ``ORG/NAME``."""


@dataclass(frozen=True)
class Checkpoint:
    """One Hugging Face model folder.

    Attributes:
        folder: the folder (a cache snapshot or a folder the user saved).
        name: what the user called it (the folder's name, or ``ORG/NAME`` from the cache).
        config: config.json, parsed.
        shards: the safetensors files, in order; each tensor lives in exactly one.
        revision: the cache snapshot's commit, or None for a plain folder.
    """

    folder: Path
    name: str
    config: dict[str, Any]
    shards: tuple[Path, ...]
    revision: str | None = None

    def file(self, name: str) -> Path | None:
        """The folder's file ``name`` (``tokenizer.json``, ...), or None where there is none.

        Raises:
            CheckpointError: something else stands in its place (a FIFO, a device, a folder, a
                symlink loop, a broken symlink); names it.
            DataError: it cannot be read by this user (permission denied).
        """
        path = self.folder / name
        problem = file_problem(path)
        if problem is None:
            return path
        if problem.missing:
            return None
        raise problem.error()

    def json_file(self, name: str) -> dict[str, Any]:
        """The folder's JSON file ``name``, parsed; empty where there is none."""
        path = self.file(name)
        return {} if path is None else read_json(path)

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", ""))

    def files(self) -> list[Path]:
        """Every file of the folder attnlab reads: config.json, the weights (and their index), the
        tokenizer's files (for their SHA-256: :mod:`attnlab.pretrained.provenance`)."""
        index = self.file(INDEX_FILE)
        tokenizer = [path for name in TOKENIZER_FILES if (path := self.file(name)) is not None]
        return [self.folder / "config.json", *([index] if index else []), *self.shards, *tokenizer]


def is_checkpoint_folder(path: Path) -> bool:
    """Whether ``path`` is a Hugging Face model folder (config.json with a ``model_type``), not an
    attnlab run. A config.json that does not parse or cannot be read (no permission, a FIFO in its
    place) belongs to a model folder when files only such a folder has stand beside it (its damage
    is then named as a model folder's)."""
    config = path / "config.json"
    if not os.path.lexists(config) or os.path.lexists(path / "manifest.json"):
        return False
    try:
        data = read_json(config)
    except AttnlabError:
        return any(os.path.lexists(path / name) for name in (INDEX_FILE, *TOKENIZER_FILES[1:]))
    return "model_type" in data or not {"task", "model", "train"} & data.keys()  # none of a run's sections


def find_checkpoint(source: str | os.PathLike[str], *, revision: str | None = None) -> Checkpoint:
    """The checkpoint ``source`` names: a model folder, or a model name in the local Hugging Face cache.

    Args:
        source: a folder holding config.json and safetensors weights, or ``NAME`` / ``ORG/NAME``
            of a model in the cache (:func:`hub_cache`), resolved offline.
        revision: the cache snapshot to take: a commit hash (or its first characters) or a ref
            such as ``main``; default the snapshot ``refs/main`` points at, or the only one.

    Raises:
        UsageError: nothing at ``source`` and no such model in the cache (the message says where
            it looked), or a revision the cache does not hold.
        CheckpointError: config.json or the weights' index is unreadable, or a shard is missing.
    """
    path = Path(source).expanduser()
    if os.path.lexists(path) and not path.exists():  # a symlink loop, a broken symlink
        raise UsageError(str(file_problem(path).message))
    if path.is_dir():
        if revision is not None:
            raise UsageError(f"--revision: {path} is a folder, not a model name in the Hugging Face cache")
        return _open_folder(path, name=path.resolve().name, revision=None)
    if path.exists():
        raise UsageError(f"{path}: not a model folder (a folder with config.json and *.safetensors) or a run")
    text = str(source)
    if not MODEL_NAME.match(text):
        raise UsageError(f"run not found: {text} (no such run directory, model folder or GGUF file)")
    snapshot, commit = _cached_snapshot(text, revision)
    return _open_folder(snapshot, name=text, revision=commit)


def hub_cache() -> Path:
    """The Hugging Face cache's ``hub`` folder: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
    ``~/.cache/huggingface/hub`` (huggingface_hub's own rule, without importing it)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def _cached_snapshot(name: str, revision: str | None) -> tuple[Path, str]:
    """(snapshot folder, commit) of model ``name`` in the cache; one UsageError saying where it looked."""
    repo = hub_cache() / ("models--" + name.replace("/", "--"))
    snapshots = repo / "snapshots"
    available = sorted(p.name for p in snapshots.iterdir() if p.is_dir()) if snapshots.is_dir() else []
    if not available:
        raise UsageError(
            f"run not found: {name}: no such folder, and no model of that name in the Hugging Face cache "
            f"(looked in {repo}; "
            "set HF_HUB_CACHE or HF_HOME to another cache). attnlab never downloads models"
        )
    wanted = revision or "main"
    ref = repo / "refs" / wanted
    if ref.is_file():
        commit = ref.read_text(encoding="utf-8").strip()
    else:
        matches = [each for each in available if each.startswith(wanted)] if revision else []
        if len(matches) == 1:
            commit = matches[0]
        elif revision is None and len(available) == 1:
            commit = available[0]
        else:
            what = f"revision {revision!r}" if revision else "a revision 'main'"
            raise UsageError(
                f"--revision: the cache holds no {what} of {name}; snapshots: {', '.join(available)}"
                + (" (give --revision)" if revision is None else "")
            )
    if commit not in available:
        raise UsageError(f"--revision: {ref} points at {commit}, which is not among the snapshots in {snapshots}")
    return snapshots / commit, commit


def _open_folder(folder: Path, *, name: str, revision: str | None) -> Checkpoint:
    config_path = folder / "config.json"
    problem = file_problem(config_path)
    if problem is not None and problem.missing:
        raise UsageError(f"{folder}: no config.json: not a Hugging Face model folder or an attnlab run")
    config = read_json(config_path)
    if not isinstance(config.get("model_type"), str):
        raise CheckpointError(
            f"{config_path}: config.json has no model_type: attnlab cannot tell which architecture this is"
        )
    return Checkpoint(folder, name, config, _shards(folder), revision)


def _shards(folder: Path) -> tuple[Path, ...]:
    """The weight files: the index's shards (each checked to exist), or model.safetensors."""
    index_path = folder / INDEX_FILE
    if os.path.lexists(index_path):
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: no 'weight_map' of tensor names to files")
        names = sorted(set(map(str, weight_map.values())))
        for shard in names:
            if Path(shard).name != shard:
                raise CheckpointError(f"{index_path}: shard {shard!r} is not a file name in {folder}")
            if (problem := file_problem(folder / shard)) is not None:
                if problem.missing:
                    raise CheckpointError(f"{index_path}: shard {shard} is missing from {folder}")
                raise problem.error()
        return tuple(folder / shard for shard in names)
    single = folder / SINGLE_FILE
    problem = file_problem(single)
    if problem is None:
        return (single,)
    if not problem.missing:
        raise problem.error()
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise CheckpointError(
            f"{folder}: only pickled weights (*.bin); attnlab reads safetensors only (never pickle). Convert "
            "them once with transformers: AutoModel.from_pretrained(folder).save_pretrained(folder)"
        )
    raise CheckpointError(f"{folder}: no {SINGLE_FILE} and no {INDEX_FILE}")


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from the model folder's file ``path``, read within
    :data:`~attnlab.limits.MAX_INPUT_BYTES`.

    Raises:
        CheckpointError: missing, not a regular file (a FIFO, a device, a folder, a symlink loop),
            larger than the cap, not UTF-8 JSON, or not an object; names the file and the cause.
        DataError: this user may not read it (permission denied, exit 2).
    """
    if (problem := file_problem(path)) is not None:
        raise problem.error()
    try:
        raw = read_capped(path)
    except DataError:
        raise CheckpointError(
            f"{path}: more than {MAX_INPUT_BYTES:,} bytes, more than any model's JSON file holds "
            "(attnlab.limits.MAX_INPUT_BYTES)"
        ) from None
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read: {describe_os_error(error)}") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise CheckpointError(f"{path}: not readable JSON ({error})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a shard, not yet read: where its bytes lie and how to get them.

    :meth:`view` is the tensor itself, a view of the shard's private memory map (no copy: pages are
    read from the disk cache when first used, and a write stays in this process); :meth:`read`
    copies it out of the file with ordinary reads (no page of the mapping becomes resident), for
    tensors that must be changed (transposed, reordered, cast, stacked) anyway.
    """

    name: str
    shard: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    """Offset of the first byte in the file."""
    end: int
    mapping: torch.UntypedStorage
    """The whole shard, memory-mapped with ``MAP_PRIVATE``."""

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    def follows(self, other: StoredTensor) -> bool:
        """Whether this tensor's bytes start where ``other``'s end, in the same file and dtype."""
        return self.shard == other.shard and self.dtype == other.dtype and self.begin == other.end

    def view(self, shape: tuple[int, ...] | None = None, *, through: StoredTensor | None = None) -> Tensor | None:
        """The tensor as a view of the mapping, or None where its offset is not aligned for its
        dtype (files of early writers). With ``through``, the bytes of this tensor up to the end of
        ``through`` (tensors that each :meth:`follows` the one before), as one tensor of ``shape``:
        tensors stacked along dim 0 without a copy."""
        item = self.dtype.itemsize
        if self.begin % item:
            return None
        end = (through or self).end
        flat = torch.empty(0, dtype=self.dtype).set_(self.mapping, self.begin // item, ((end - self.begin) // item,))
        return flat.view(self.shape if shape is None else shape)

    def read(self, out: Tensor | None = None) -> Tensor:
        """This tensor's bytes read from the file into ``out`` (contiguous, of its dtype and number
        of elements; default: a fresh tensor of its shape)."""
        out = torch.empty(self.shape, dtype=self.dtype) if out is None else out
        buffer = memoryview(out.view(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        try:
            with open(self.shard, "rb", buffering=0) as file:
                file.seek(self.begin)
                done = 0
                while done < self.nbytes:
                    count = file.readinto(buffer[done:])
                    if not count:
                        raise CheckpointError(f"{self.shard}: tensor {self.name!r} is cut short (file truncated)")
                    done += count
        except OSError as error:
            why = describe_os_error(error)
            raise CheckpointError(f"{self.shard}: cannot read tensor {self.name!r}: {why}") from None
        return out


def read_tensors(checkpoint: Checkpoint) -> Iterator[tuple[str, StoredTensor]]:
    """Every tensor of the checkpoint as (name, :class:`StoredTensor`), in file order, in its stored dtype.

    Each shard is opened with ``safetensors`` first, which checks its header and that every
    tensor's bytes lie within the file, then mapped once (``MAP_PRIVATE``, nothing read until
    used). Tensors used as stored stay views of that mapping, as ``from_pretrained`` keeps them
    (the pages are the disk cache's, counted in the RSS once touched); tensors that must be
    changed are read with ordinary reads, so their mapped pages never become resident. A name in
    two shards, or an index listing a tensor its shard lacks, is a CheckpointError.
    """
    seen: dict[str, Path] = {}
    listed = _index_names(checkpoint)
    for shard in checkpoint.shards:
        with _open_shard(shard) as handle:
            names = list(handle.offset_keys())
        spans = _header_spans(shard)
        mapping = torch.UntypedStorage.from_file(str(shard), shared=False, nbytes=shard.stat().st_size)
        for name in names:
            if name in seen:
                raise CheckpointError(f"{shard}: tensor {name!r} is also in {seen[name].name}")
            if listed is not None and listed.get(name) != shard.name:
                raise CheckpointError(f"{shard}: tensor {name!r} is not where {INDEX_FILE} puts it")
            seen[name] = shard
            dtype, shape, begin, end = spans[name]
            yield name, StoredTensor(name, shard, dtype, shape, begin, end, mapping)
    if listed is not None:
        missing = sorted(set(listed) - set(seen))
        if missing:
            raise CheckpointError(
                f"{checkpoint.folder / listed[missing[0]]}: tensor {missing[0]!r} listed in the index is missing"
            )


def file_views(path: Path) -> dict[str, Tensor]:
    """Every tensor of the safetensors file ``path`` as a view of its map (``MAP_PRIVATE``):
    file-backed pages, read when used (attnlab's own offload files, :mod:`attnlab.pretrained.placement`)."""
    with _open_shard(path) as handle:  # safetensors checks the header and the spans first
        names = list(handle.offset_keys())
    spans = _header_spans(path)
    mapping = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=path.stat().st_size)
    views = {}
    for name in names:
        dtype, shape, begin, end = spans[name]
        stored = StoredTensor(name, path, dtype, shape, begin, end, mapping)
        view = stored.view()
        views[name] = stored.read() if view is None else view  # an unaligned offset: read, not mapped
    return views


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _header_spans(shard: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]:
    """name -> (dtype, shape, first byte, end byte) in the file, from the safetensors header (an
    8-byte little-endian length, then JSON with each tensor's ``data_offsets`` counted from the
    header's end). ``safe_open`` has already checked the header against the file."""
    with open(shard, "rb") as file:
        length = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(length))
    base = 8 + length
    spans = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in _DTYPES:
            raise CheckpointError(f"{shard}: tensor {name!r} has dtype {entry['dtype']}, which attnlab does not read")
        begin, end = entry["data_offsets"]
        spans[name] = (_DTYPES[entry["dtype"]], tuple(entry["shape"]), base + begin, base + end)
    return spans


def _index_names(checkpoint: Checkpoint) -> dict[str, str] | None:
    index_path = checkpoint.file(INDEX_FILE)
    if index_path is None:
        return None
    return {str(k): str(v) for k, v in read_json(index_path)["weight_map"].items()}


def _open_shard(shard: Path) -> Any:
    """``safe_open`` on ``shard`` with its structure checked: the header parses and every tensor's
    bytes lie within the file (safetensors checks this when it opens it). What stands in a file's
    place (a FIFO, ``/dev/zero``, a symlink loop) or a permission denied is named first: safetensors
    would call each "No such file or directory"."""
    if (problem := file_problem(shard)) is not None:
        raise problem.error()
    try:
        handle = safe_open(str(shard), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"{shard}: not a complete safetensors file ({error})") from None
    return handle


def storage_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``float32``, ``bfloat16`` or ``float16`` (also ``fp32``, ``bf16``, ``fp16``)."""
    dtypes = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
        "float64": torch.float64,
    }
    if name not in dtypes:
        raise UsageError(f"--dtype: unknown {name!r}; allowed: float32, bfloat16, float16, float64")
    return dtypes[name]
