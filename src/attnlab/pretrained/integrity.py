"""Structural checks of model files from outside: what a GGUF or safetensors file must be to be used.

A file from outside comes with no manifest of ours, so what can be checked is what its format and
the families' conventions allow. Every refusal is a :class:`~attnlab.errors.CheckpointError`
(exit 3) in our words, naming the file and the field or tensor; values that are possible but
unusual enough to suggest damage are an :class:`~attnlab.errors.AttnlabWarning`.

GGUF (:func:`check_gguf_layout`, before the ``gguf`` reader maps anything, then
:func:`check_gguf_metadata`):

* the header walked with every length and count bounded by the file: a key, string or array that
  runs past the end of the file is named, where numpy or ``gguf`` would say "index 0 is out of
  bounds" or "When changing to a larger dtype...";
* the tensor table: known tensor types, positive dimensions, a first dimension that fills whole
  quantization blocks, and byte ranges that lie inside the file and tile its data section in
  order (each tensor ends where the next one starts, give or take the alignment padding). A type
  byte flipped (Q4_1 read as Q4_0: weights off by 1.58) or an offset moved (a norm weight read
  from the middle of another tensor: 3.05e37) breaks the tiling and is named;
* metadata: rope base, RMS epsilon and context length within the ranges below; special token ids
  within the vocabulary and, where the file types its tokens, naming control tokens (a warning),
  the end-of-text token one the chat template writes (a warning); the chat template parses as Jinja.

Weights (:func:`check_weights`, for each tensor read from a GGUF or safetensors file): finite, and
no larger than :data:`WEIGHT_MAX` (:data:`NORM_WEIGHT_MAX` for a norm's weight). safetensors itself
refuses a header whose byte ranges leave the file, overlap, or disagree with dtype and shape
(:mod:`attnlab.pretrained.checkpoint` names the file), and the families' layouts check every shape
against config.json.

What no structural check can see, and only a known SHA-256 can (:mod:`attnlab.pretrained.provenance`:
the files of packages attnlab names): a float's low mantissa bits (rope base 100000 -> 100000.0078
is a warning here, not a refusal, since a family could use any base), an RMS epsilon changed to
another plausible value, a context length of 8193 (a warning: an odd length), special ids moved
to other control tokens, a chat template changed into another valid one, zeroed data blocks, and
flipped bits in quantized data that stay within the ranges below.
"""

from __future__ import annotations

import math
import mmap
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnlab.errors import AttnlabWarning, CheckpointError
from attnlab.reading import describe_os_error, file_problem

__all__ = [
    "ROPE_BASE_RANGE",
    "RMS_EPS_RANGE",
    "CONTEXT_LENGTH_MAX",
    "WEIGHT_MAX",
    "NORM_WEIGHT_MAX",
    "check_gguf_layout",
    "check_gguf_metadata",
    "check_chat_template",
    "check_model_section",
    "check_weights",
]

ROPE_BASE_RANGE = (1.0, 1e9)
"""Rotary bases the families use lie between 1e4 (Llama 2, Gemma, Phi-3) and 5e7 (InternLM2.5):
anything outside [1, 1e9] is a damaged value (a flipped exponent bit), never a model."""

RMS_EPS_RANGE = (1e-12, 1e-2)
"""Norm epsilons the families use lie between 1e-12 (BERT) and 1e-5 (Llama, Phi-3); [1e-12, 1e-2]
leaves room, and refuses what an exponent flip gives (0, 3.4e33)."""

CONTEXT_LENGTH_MAX = 1 << 24
"""The longest context any family declares is 10M tokens (Llama 4 Scout): beyond 2^24 is damage."""

WEIGHT_MAX = 1e4
"""The largest weights of the families' released checkpoints, outlier dimensions included, stay
below about 1e3; a flipped exponent bit in a float16 block scale gives 1e4 and more."""

NORM_WEIGHT_MAX = 1e3
"""Norm weights (RMSNorm and LayerNorm gains and biases) stay below about 1e2 in every family."""

_ROUND_DIGITS = 3
"""A rope base or an epsilon a family chose is a round number: at most this many significant digits."""


# ---- GGUF: the header and the tensor table -------------------------------------------------------

# GGUF value types (gguf.GGUFValueType): the struct format of each fixed-size one
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    shape: tuple[int, ...]
    kind: int
    offset: int
    size: int


class _Cursor:
    """Reads a GGUF header front to back; anything that runs past the end is named."""

    def __init__(self, data: Any, path: Path) -> None:
        self.data, self.path, self.at = data, path, 0

    def take(self, count: int, what: str) -> bytes:
        if count < 0 or self.at + count > len(self.data):
            raise CheckpointError(
                f"{self.path} is damaged: {what} ({count} bytes at offset {self.at}) runs past the end of the "
                f"file ({len(self.data)} bytes)"
            )
        chunk = self.data[self.at : self.at + count]
        self.at += count
        return chunk

    def scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        raw = self.take(self.scalar("<Q", what), what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(f"{self.path} is damaged: {what} is not UTF-8") from None

    def value(self, kind: int, what: str) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind], what)
        if kind == _STRING:
            return self.string(what)
        if kind == _ARRAY:
            item, count = self.scalar("<I", what), self.scalar("<Q", what)
            if item in _SCALARS:  # skipped whole: a token-type array has one entry per token
                self.take(count * struct.calcsize(_SCALARS[item]), what)
                return None
            if item not in (_STRING, _ARRAY):
                raise CheckpointError(f"{self.path} is damaged: {what} is an array of unknown type {item}")
            if count > len(self.data) - self.at:  # every element takes at least one byte
                raise CheckpointError(
                    f"{self.path} is damaged: {what} claims {count} elements, more than the file holds"
                )
            for _ in range(count):
                self.value(item, what)
            return None
        raise CheckpointError(f"{self.path} is damaged: {what} has unknown value type {kind}")


def check_gguf_layout(path: Path) -> None:
    """Walk the GGUF file ``path``'s header and tensor table (see the module docstring).

    Raises:
        CheckpointError: not a GGUF file, or a header, tensor type, shape or byte range that is
            impossible, or not a regular file (a FIFO, a device, a symlink loop); names the file
            and the key, tensor or cause.
        DataError: this user may not read the file (permission denied).
    """
    if (problem := file_problem(path)) is not None:  # a FIFO is never opened, a device never mapped
        raise problem.error()
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, 2)
            if size == 0:
                raise CheckpointError(f"{path} is not a GGUF file: it is empty")
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
                _check_layout(_Cursor(data, path), size)
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read: {describe_os_error(error)}") from None


def _check_layout(cursor: _Cursor, size: int) -> None:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # the tensor types' block sizes

    path = cursor.path
    if cursor.take(4, "the magic number") != b"GGUF":
        raise CheckpointError(f"{path} is not a GGUF file: it does not start with 'GGUF'")
    version = cursor.scalar("<I", "the version")
    if version not in (2, 3):
        raise CheckpointError(f"{path} is damaged or too new: GGUF version {version} (attnlab reads 2 and 3)")
    tensor_count = cursor.scalar("<Q", "the tensor count")
    key_count = cursor.scalar("<Q", "the metadata key count")
    if tensor_count > size // 24 or key_count > size // 13:  # the smallest tensor entry and key take that much
        raise CheckpointError(f"{path} is damaged: {tensor_count} tensors and {key_count} metadata keys cannot fit")
    alignment = _DEFAULT_ALIGNMENT
    for number in range(key_count):
        key = cursor.string(f"metadata key #{number}")
        value = cursor.value(cursor.scalar("<I", f"metadata key {key!r}"), f"metadata key {key!r}")
        if key == "general.alignment":
            if not isinstance(value, int) or value < 1 or value & (value - 1):
                raise CheckpointError(f"{path} is damaged: general.alignment {value!r} is not a power of two")
            alignment = value
    tensors = []
    for number in range(tensor_count):
        name = cursor.string(f"tensor #{number}'s name")
        what = f"tensor {name!r}"
        dims = cursor.scalar("<I", what)
        if not 1 <= dims <= _MAX_DIMS:
            raise CheckpointError(f"{path} is damaged: {what} has {dims} dimensions")
        shape = tuple(cursor.scalar("<Q", what) for _ in range(dims))
        kind, offset = cursor.scalar("<I", what), cursor.scalar("<Q", what)
        if kind not in GGML_QUANT_SIZES:
            raise CheckpointError(f"{path} is damaged: {what} has unknown tensor type {kind}")
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        if min(shape) < 1 or shape[0] % block or math.prod(shape) > size * block:
            raise CheckpointError(
                f"{path} is damaged: {what} has shape {list(shape)}, impossible for type "
                f"{GGMLQuantizationType(kind).name} (blocks of {block})"
            )
        tensors.append(_TensorInfo(name, shape, kind, offset, math.prod(shape) // block * block_bytes))
    _check_tiling(path, tensors, start=-(-cursor.at // alignment) * alignment, size=size, alignment=alignment)


def _check_tiling(path: Path, tensors: list[_TensorInfo], *, start: int, size: int, alignment: int) -> None:
    """Each tensor's bytes inside the data section, in order, each ending where the next begins
    (up to the alignment padding)."""
    from gguf.constants import GGMLQuantizationType

    expected, where, before = 0, "", "the start of the data"
    for tensor in sorted(tensors, key=lambda t: t.offset):
        kind = GGMLQuantizationType(tensor.kind).name
        where = (
            f"tensor {tensor.name!r} ({kind}, shape {list(tensor.shape)}, {tensor.size} bytes at data offset "
            f"{tensor.offset})"
        )
        if tensor.offset % alignment:
            raise CheckpointError(f"{path} is damaged: {where} is not aligned to {alignment} bytes")
        if start + tensor.offset + tensor.size > size:
            raise CheckpointError(f"{path} is damaged: {where} runs past the end of the file ({size} bytes)")
        if tensor.offset < expected:
            raise CheckpointError(
                f"{path} is damaged: the tensors do not tile the data: {where} overlaps {before}, which ends at "
                f"data offset {expected} (a tensor's type, shape or offset is wrong)"
            )
        gap = tensor.offset - expected
        if gap >= alignment:
            fits = [t.name for t in tensors if -(-t.size // alignment) * alignment == gap]
            hint = f"; {fits[0]!r} has that size: its offset may have moved" if fits else ""
            raise CheckpointError(
                f"{path} is damaged: the tensors do not tile the data: {where} starts {gap} bytes after {before} "
                f"ends (a tensor's type, shape or offset is wrong{hint})"
            )
        expected, before = tensor.offset + tensor.size, where
    if size - (start + expected) >= alignment and tensors:
        raise CheckpointError(
            f"{path} is damaged: the last {where} ends {size - start - expected} bytes before the end of the "
            f"file: a tensor's type, shape or offset is wrong"
        )


# ---- GGUF: metadata ------------------------------------------------------------------------------


def check_gguf_metadata(path: Path, metadata: dict[str, Any]) -> None:
    """Rope base, norm epsilon, context length, special ids and chat template of a GGUF file
    within what a model can have (see the module docstring).

    Raises:
        CheckpointError: a value no model has; names the file and the key.
    """
    arch = str(metadata.get("general.architecture", ""))
    for key, bounds in (
        (f"{arch}.rope.freq_base", ROPE_BASE_RANGE),
        (f"{arch}.attention.layer_norm_rms_epsilon", RMS_EPS_RANGE),
        (f"{arch}.attention.layer_norm_epsilon", RMS_EPS_RANGE),
    ):
        if key in metadata:
            _check_real(path, key, metadata[key], bounds)
    context = metadata.get(f"{arch}.context_length")
    if isinstance(context, int) and not isinstance(context, bool):
        if not 1 <= context <= CONTEXT_LENGTH_MAX:
            raise CheckpointError(
                f"{path} is damaged: {arch}.context_length {context} is not in [1, {CONTEXT_LENGTH_MAX}]"
            )
        if context % 2:
            _warn(path, f"{arch}.context_length {context} is odd (every family's is even)")
    template = metadata.get("tokenizer.chat_template")
    if template:
        check_chat_template(str(template), path=path, field="tokenizer.chat_template")
    _check_special_ids(path, metadata)  # after the template, which they are compared with


def _check_real(path: Path, key: str, value: Any, bounds: tuple[float, float]) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return  # a wrong type is named where the value is read (attnlab.pretrained.gguf)
    low, high = bounds
    if not (math.isfinite(value) and low <= value <= high):
        raise CheckpointError(f"{path} is damaged: {key} {value:.6g} is not in [{low:g}, {high:g}]")
    if not _is_round(value):
        _warn(path, f"{key} {value!r} is not a round number, as the families' are (a flipped bit?)")


def _is_round(value: float) -> bool:
    """Whether ``value`` is k x 10^e with k of at most :data:`_ROUND_DIGITS` digits, as stored in
    float32 or float64 (1e-5 is stored as 9.99999974738e-06)."""
    rounded = float(f"{value:.{_ROUND_DIGITS}g}")  # the double nearest the decimal k x 10^e
    return rounded == value or float(np.float32(rounded)) == value


def _check_special_ids(path: Path, metadata: dict[str, Any]) -> None:
    tokens = metadata.get("tokenizer.ggml.tokens")
    types = metadata.get("tokenizer.ggml.token_type")
    if not isinstance(tokens, list | tuple):
        return
    for role in ("bos", "eos", "padding", "unknown", "eot"):
        key = f"tokenizer.ggml.{role}_token_id"
        value = metadata.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < len(tokens):
            raise CheckpointError(f"{path} is damaged: {key} {value!r} is not a token id below {len(tokens)}")
        if isinstance(types, list | tuple) and len(types) == len(tokens) and types[value] not in (2, 3):
            _warn(path, f"{key} {value} names {tokens[value]!r}, not a control token (moved?)")
        template = str(metadata.get("tokenizer.chat_template") or "")
        if role == "eos" and template and tokens[value] not in template and "eos_token" not in template:
            _warn(path, f"{key} {value} names {tokens[value]!r}, which the chat template never writes (moved?)")


def check_chat_template(template: str, *, path: Path, field: str) -> None:
    """The chat template parses as Jinja (as :mod:`attnlab.generate.chat` renders it).

    Raises:
        CheckpointError: a syntax error; names the file, the field and the template's line.
    """
    from jinja2 import TemplateSyntaxError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment(extensions=[loopcontrols]).parse(template)
    except TemplateSyntaxError as error:
        raise CheckpointError(
            f"{path} is damaged: {field} is not a valid Jinja template (line {error.lineno}: {error.message})"
        ) from None


def _warn(path: Path, message: str) -> None:
    warnings.warn(f"{path}: {message}", AttnlabWarning, stacklevel=3)


# ---- Hugging Face config.json ------------------------------------------------------------------------

_SECTION_RANGES = {"rope_base": ROPE_BASE_RANGE, "local_rope_base": ROPE_BASE_RANGE, "layer_norm_eps": RMS_EPS_RANGE}


def check_model_section(section: dict[str, Any], *, path: Path) -> None:
    """The values of a model read from config.json ``path`` (attnlab's ``[model]`` section) within
    what a model can have: rope bases, the norm epsilon and the context length (as for GGUF).

    Raises:
        CheckpointError: a value no model has; names the file and the field.
    """
    for key, bounds in _SECTION_RANGES.items():
        if key in section:
            _check_real(path, f"model.{key}", section[key], bounds)
    context = section.get("max_len")
    if isinstance(context, int) and not 1 <= context <= CONTEXT_LENGTH_MAX:
        raise CheckpointError(
            f"{path} is damaged: its context length (model.max_len) {context} is not in [1, {CONTEXT_LENGTH_MAX}]"
        )


# ---- weights ---------------------------------------------------------------------------------------


def check_weights(name: str, values: np.ndarray | torch.Tensor, *, path: Path) -> None:
    """A weight read from ``path``: finite and within :data:`WEIGHT_MAX` (:data:`NORM_WEIGHT_MAX`
    for a norm's). One pass over the values (their minimum and maximum).

    Raises:
        CheckpointError: NaN, infinite or implausibly large values; names the file and the tensor.
    """
    if isinstance(values, np.ndarray):
        values = torch.from_numpy(values)
    if not values.is_floating_point() or values.numel() == 0:
        return
    low, high = (float(v) for v in torch.aminmax(values))
    if not (math.isfinite(low) and math.isfinite(high)):
        raise CheckpointError(f"{path} is damaged: tensor {name!r} holds NaN or infinite values")
    limit = NORM_WEIGHT_MAX if "norm" in name else WEIGHT_MAX
    largest = max(-low, high)
    if largest > limit:
        raise CheckpointError(
            f"{path} is damaged: tensor {name!r} holds a value of {largest:.3g}, beyond the {limit:g} any "
            f"model's {'norm weights' if limit == NORM_WEIGHT_MAX else 'weights'} reach"
        )
