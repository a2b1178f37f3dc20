"""Read a Llama-family language model from a GGUF file (llama.cpp's format).

A GGUF file holds the whole model (:mod:`attnlab.pretrained.gguf_file` reads its metadata: the
shape, the tokenizer, the chat template), then the weights, most of them quantized in blocks (Q4_1:
32 weights share a scale and a minimum). A GGUF file is opened as the Hugging Face checkpoint it
was converted from: its metadata as the config.json of ``LlamaForCausalLM``
(:meth:`~attnlab.pretrained.gguf_file.LlamaHyperparameters.config_json`), its tensors dequantized
to float32 once (by the ``gguf`` package) and renamed to Hugging Face's (:data:`HF_NAMES`:
``blk.N.attn_q.weight`` is ``model.layers.N.self_attn.q_proj.weight``), with what llama.cpp's
converter changed undone; then the ``llama`` family of :mod:`attnlab.pretrained.families` maps
them onto attnlab's decoder, as it maps a Hugging Face folder's (:func:`read_gguf`).

llama.cpp's converter stores W_Q and W_K with the rows of each head permuted: it rotates adjacent
pairs (x_0, x_1), (x_2, x_3), ... of a head, where the Hugging Face layout (and attnlab's, see
:mod:`attnlab.nn.positional`) rotates (x_i, x_{i + d/2}). Row 2i of a stored head is row i of
the original and row 2i + 1 is row i + d/2; :func:`unpermute_rotary_rows` undoes that.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import quants

from attnlab.errors import ConfigError, DataError
from attnlab.experiment import ExperimentConfig, model_config_for_task
from attnlab.nn import build_model_to_load
from attnlab.pretrained.families import FAMILIES
from attnlab.pretrained.gguf_file import (
    DEFAULT_PACKAGE,
    GGUFFile,
    LlamaHyperparameters,
    chat_template,
    gguf_tokenizer,
    llama_hyperparameters,
    open_gguf,
    package_gguf,
    special_tokens,
)
from attnlab.pretrained.integrity import check_weights
from attnlab.pretrained.layout import HeldTensor, Layout, fill_state, layout_sources, take_weights
from attnlab.pretrained.provenance import check_sources
from attnlab.run.directory import RunDir
from attnlab.tasks.registry import build_task
from attnlab.tokenizers import Tokenizer

__all__ = [
    "DEFAULT_PACKAGE",
    "GGUFFile",
    "LlamaHyperparameters",
    "open_gguf",
    "package_gguf",
    "llama_hyperparameters",
    "HF_NAMES",
    "hf_name",
    "hf_tensors",
    "unpermute_rotary_rows",
    "DEQUANTIZABLE",
    "ImportedGGUF",
    "import_gguf",
    "ReadGGUF",
    "read_gguf",
]

DEQUANTIZABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
"""Tensor types attnlab imports (dequantized by ``gguf.quants``); any other is named in an error."""


# ---- the tensors, as Hugging Face names them --------------------------------------------------------

HF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.N.attn_q.weight": "model.layers.N.self_attn.q_proj.weight",
    "blk.N.attn_k.weight": "model.layers.N.self_attn.k_proj.weight",
    "blk.N.attn_v.weight": "model.layers.N.self_attn.v_proj.weight",
    "blk.N.attn_output.weight": "model.layers.N.self_attn.o_proj.weight",
    "blk.N.ffn_gate.weight": "model.layers.N.mlp.gate_proj.weight",
    "blk.N.ffn_up.weight": "model.layers.N.mlp.up_proj.weight",
    "blk.N.ffn_down.weight": "model.layers.N.mlp.down_proj.weight",
    "blk.N.attn_norm.weight": "model.layers.N.input_layernorm.weight",
    "blk.N.ffn_norm.weight": "model.layers.N.post_attention_layernorm.weight",
}
"""GGUF's tensor names of a llama model -> Hugging Face's (``N``: the block, the layer): the one
name table of GGUF files; the ``llama`` family's layout takes it from there."""


def hf_name(name: str) -> str:
    """A GGUF tensor name -> its name in Hugging Face's ``LlamaForCausalLM`` ("" for none)."""
    pattern, layer = _pattern(name)
    return HF_NAMES[pattern].replace(".N.", f".{layer}.", 1) if pattern in HF_NAMES else ""


def _pattern(name: str) -> tuple[str, str]:
    """(``name`` with its block number as ``N``, the number); ``name`` itself outside the blocks."""
    block, layer, rest = name.split(".", 2) if name.startswith("blk.") else ("", "", "")
    if block == "blk" and layer.isdigit():
        return f"blk.N.{rest}", layer
    return name, ""


def unpermute_rotary_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of W_Q or W_K (see the module docstring).

    Row 2i + j of head h in the file (j = 0, 1) is row j * d/2 + i of head h in the rotary layout
    that rotates (x_i, x_{i + d/2}).

    Shape:
        weight: (heads * d, d_in);  returns the same shape.
    """
    rows, width = weight.shape
    half = rows // heads // 2
    pairs = weight.reshape(heads, half, 2, width)  # (H, d/2, 2, d_in): file order
    return pairs.swapaxes(1, 2).reshape(rows, width)  # (H, 2, d/2, d_in) -> (H*d, d_in)


def _query_heads(hp: LlamaHyperparameters) -> int:
    return hp.heads


def _key_heads(hp: LlamaHyperparameters) -> int:
    return hp.kv_heads


_PERMUTED: dict[str, Callable[[LlamaHyperparameters], int]] = {
    "blk.N.attn_q.weight": _query_heads,
    "blk.N.attn_k.weight": _key_heads,
}
"""The tensors llama.cpp's converter stored with each head's rows permuted -> their number of heads."""


def _as_converted_from(tensor: Any, values: np.ndarray, hp: LlamaHyperparameters, where: Path) -> np.ndarray:
    """``values`` of GGUF tensor ``tensor`` as Hugging Face's checkpoint held them: W_Q and W_K
    with their rows unpermuted (:func:`unpermute_rotary_rows`), every other tensor as stored.

    Raises:
        DataError: a permuted tensor that is not (heads x head size, d_model), named.
    """
    heads_of = _PERMUTED.get(_pattern(tensor.name)[0])
    if heads_of is None:
        return values
    heads = heads_of(hp)
    expected = (heads * hp.head_dim, hp.d_model)
    if values.shape != expected:
        raise DataError(f"{where}: tensor {tensor.name!r} has shape {values.shape}, expected {expected}")
    return unpermute_rotary_rows(values, heads)


_ROWS_PER_BLOCK = 2048  # rows dequantized at a time: gguf's intermediates stay a few MB


def _dequantized(tensor: Any, where: Path) -> np.ndarray:
    """The tensor in float32, dequantized by ``gguf.quants`` a block of rows at a time into one
    array (the whole-tensor call's intermediates cost 2-3 times the output for the embedding)."""
    kind = tensor.tensor_type.name
    if kind not in DEQUANTIZABLE:
        raise ConfigError(f"{where}: tensor {tensor.name!r} has type {kind}, which attnlab does not import")
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))  # GGUF lists dims innermost first
    rows = tensor.data.reshape(shape[0], -1) if len(shape) > 1 else tensor.data.reshape(1, -1)
    out = np.empty((rows.shape[0], math.prod(shape[1:]) if len(shape) > 1 else shape[0]), dtype=np.float32)
    try:
        for first in range(0, rows.shape[0], _ROWS_PER_BLOCK):
            block = quants.dequantize(rows[first : first + _ROWS_PER_BLOCK], tensor.tensor_type)
            out[first : first + _ROWS_PER_BLOCK] = block.reshape(-1, out.shape[1])
    except (ValueError, NotImplementedError) as error:
        raise DataError(f"{where}: tensor {tensor.name!r} ({kind}) cannot be dequantized: {error}") from None
    values = out.reshape(shape)
    check_weights(tensor.name, values, path=where)
    return values


def hf_tensors(gguf: GGUFFile, hp: LlamaHyperparameters, layout: Layout) -> Iterator[tuple[str, HeldTensor]]:
    """Every weight of the file, dequantized to float32, one at a time, under its Hugging Face name
    (:func:`hf_name`) and as Hugging Face's checkpoint held it (W_Q and W_K unpermuted); each
    keeps its GGUF name for the errors of :func:`attnlab.pretrained.layout.fill_state`.

    Raises:
        ConfigError: a tensor of a type attnlab does not import, or one ``layout`` (the llama
            family's for ``hp``) has no place for, named as the file names it.
        DataError: W_Q or W_K of the wrong shape, or non-finite values.
    """
    wanted = layout_sources(layout)
    for tensor in gguf.reader.tensors:
        name = hf_name(tensor.name)
        if name not in wanted:
            raise ConfigError(f"{gguf.path}: tensor {tensor.name!r} is not part of a Llama model attnlab implements")
        values = _as_converted_from(tensor, _dequantized(tensor, gguf.path), hp, gguf.path)
        yield name, HeldTensor(tensor.name, gguf.path, torch.from_numpy(values))


# ---- the run ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImportedGGUF:
    """What :func:`import_gguf` wrote: the run, its config and the model's shape."""

    run: Any  # attnlab.run.directory.RunDir
    experiment: Any  # attnlab.experiment.ExperimentConfig
    hyperparameters: LlamaHyperparameters
    source: Path


def _task_section(gguf: GGUFFile, hp: LlamaHyperparameters) -> dict[str, Any]:
    specials = special_tokens(gguf)
    if specials.eos is None:
        raise ConfigError(f"{gguf.path}: metadata key 'tokenizer.ggml.eos_token_id' is missing")
    if specials.add_bos and specials.bos is None:
        raise ConfigError(f"{gguf.path}: tokenizer.ggml.add_bos_token is set but bos_token_id is missing")
    return {
        "name": "pretrained_lm",
        "max_tokens": hp.context_length,
        "eos": specials.eos,
        "pad": specials.eos if specials.pad is None else specials.pad,
        "bos": -1 if specials.bos is None else specials.bos,
        "add_bos": specials.add_bos,
        "chat_template": chat_template(gguf) or "",
    }


@dataclass(frozen=True)
class ReadGGUF:
    """A GGUF file read into memory: attnlab's experiment, task, tokenizer and model (float32)."""

    experiment: ExperimentConfig
    task: Any
    tokenizer: Tokenizer
    model: Any
    state: dict[str, torch.Tensor]
    hyperparameters: LlamaHyperparameters
    source: Path


def read_gguf(path: str | Path, *, progress: Any = None, verify: bool = True) -> ReadGGUF:
    """The Llama GGUF file ``path`` as an attnlab model in memory: a ``pretrained_lm`` task and a
    ``decoder_only`` model with rotary positions, grouped-query attention, RMSNorm and SwiGLU,
    its weights dequantized to float32 once.

    Args:
        verify: check a file with a known SHA-256 (a package's: :mod:`attnlab.pretrained.provenance`).

    Raises:
        ConfigError, DataError: a file attnlab cannot read (named).
        CheckpointError: a damaged file (:mod:`attnlab.pretrained.integrity`), or one whose SHA-256
            differs from its known one.
    """
    say = progress or (lambda _message: None)
    say(f"reading {path}")
    check_sources([Path(path)], verify=verify)
    gguf = open_gguf(path)
    hp = llama_hyperparameters(gguf)
    tokenizer = Tokenizer(gguf_tokenizer(gguf))
    task_section = _task_section(gguf, hp)
    hf, family = hp.config_json(), FAMILIES["llama"]
    experiment = ExperimentConfig(task=task_section, model=family.model_section(hf, gguf.path))
    task, _ = build_task(experiment.task, saved_tokenizer=tokenizer)
    if task.vocab_size != hp.vocab_size:
        raise ConfigError(f"{gguf.path}: the tokenizer has {task.vocab_size} tokens, the model {hp.vocab_size}")
    model = build_model_to_load(model_config_for_task(experiment, task))
    say(f"dequantizing {len(gguf.reader.tensors)} tensors to float32")
    # Each weight goes into its place in attnlab's tensors as soon as it is dequantized.
    layout = family.layout(hf, hp.tied_embeddings)
    state = fill_state(
        hf_tensors(gguf, hp, layout),
        model.state_dict(),
        layout,
        hf,
        dtype=torch.float32,
        ignored=family.ignored,
        where=gguf.path,
        check_values=False,  # checked as each tensor was dequantized
        shapes_from="its metadata",
    )
    take_weights(model, state)
    state = {name: parameter.detach() for name, parameter in model.named_parameters(remove_duplicate=False)}
    return ReadGGUF(experiment, task, tokenizer, model.eval(), state, hp, gguf.path)


def import_gguf(
    path: str | Path, out: str | Path, *, overwrite: bool = False, progress: Any = None, verify: bool = True
) -> ImportedGGUF:
    """Convert the Llama GGUF file ``path`` into the run directory ``out``: config.json (task
    ``pretrained_lm``, the model of :func:`read_gguf`), tokenizer.json, model.safetensors in
    float32, dequantized once here, and provenance.json (the file's SHA-256).

    Everything is read and checked before ``out`` is touched, and the run is written whole or not at
    all (:meth:`attnlab.run.directory.RunDir.staged`), so a file attnlab cannot import or a full
    disk leaves nothing behind.
    """
    say = progress or (lambda _message: None)
    read = read_gguf(path, progress=say, verify=verify)
    sources = check_sources([Path(path)], verify=verify, record=True)
    with RunDir.staged(out, overwrite=overwrite) as run:  # in place only once complete, under its lock
        run.write_provenance([record.to_dict() for record in sources])
        run.write_config(read.experiment.to_dict())
        run.write_tokenizer(read.tokenizer.to_json())
        run.save_state_dict(read.state)
    say(f"wrote {run.path}")
    return ImportedGGUF(run, read.experiment, read.hyperparameters, read.source)
