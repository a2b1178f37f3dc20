"""An imported Hugging Face config.json checked against attnlab's caps, before anything is built.

A config.json comes from outside: a size of 10**12 would hang building the model (a list over the
heads, the layers built one by one), a special id outside the vocabulary fails every ``generate``,
a rope factor of 0 gives NaN. :func:`check_imported_config` runs on every folder opened, native or
through the bridge (:mod:`attnlab.pretrained.hf_model`), before a module exists, and refuses with
one :class:`~attnlab.errors.CheckpointError` (exit code 3: the file is invalid) naming the file and
the key:

* sizes (:data:`SIZE_KEYS`, in config.json and every sub-config such as ``text_config``): whole
  numbers in [0, cap]: layers :data:`~attnlab.limits.MAX_LAYERS`, heads
  :data:`~attnlab.limits.MAX_HEADS`, widths :data:`~attnlab.limits.MAX_MODEL_WIDTH`, vocabulary
  :data:`~attnlab.limits.MAX_VOCAB_SIZE`, positions
  :data:`~attnlab.pretrained.integrity.CONTEXT_LENGTH_MAX`;
* ``dtype`` / ``torch_dtype``: a float type (:data:`FLOAT_DTYPES`);
* special ids (``bos/eos/pad_token_id``, in config.json and generation_config.json):
  non-negative and inside the vocabulary;
* rope settings (:func:`rope_settings`): ``rope_parameters`` (flat, or by layer type) and the
  legacy ``rope_scaling`` are objects of known keys for their ``rope_type``, each number finite
  (factors, bases and betas positive, ``partial_rotary_factor`` in (0, 1]), each list a list of
  numbers where a list belongs. Where both are given, the meaning is transformers 5's (a non-empty
  ``rope_scaling`` replaces ``rope_parameters``; Gemma 3 merges it into its global layers' entry),
  and where that would drop a setting ``rope_parameters`` gives, the config is refused naming both.

:func:`check_tokenizer_fits` then refuses (:class:`~attnlab.errors.ConfigError`) a tokenizer.json
whose ids reach past the model's embedding rows, at open, not at the first ``generate``; and
:func:`check_stored_float`, as each weight arrives, one stored as integers (an int8 ``q_proj``).
A float weight stored in another float dtype than the model's (one tensor in F64 among F32 ones) is
converted to the model's dtype as it is read (:func:`attnlab.pretrained.layout.fill_state`), as
transformers does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from attnlab.errors import CheckpointError, ConfigError
from attnlab.limits import MAX_HEADS, MAX_LAYERS, MAX_MODEL_WIDTH, MAX_VOCAB_SIZE, describe_int
from attnlab.pretrained.integrity import CONTEXT_LENGTH_MAX

__all__ = [
    "SIZE_KEYS",
    "FLOAT_DTYPES",
    "ROPE_KEYS",
    "check_imported_config",
    "check_stored_float",
    "check_special_ids",
    "check_tokenizer_fits",
    "rope_settings",
]


def _keys(names: str, what: str, cap: int, cap_name: str) -> dict[str, tuple[str, int, str]]:
    return {name: (what, cap, cap_name) for name in names.split()}


SIZE_KEYS: dict[str, tuple[str, int, str]] = {
    **_keys(
        "num_hidden_layers n_layer num_layers n_layers num_decoder_layers decoder_layers encoder_layers "
        "num_encoder_layers",
        "layers",
        MAX_LAYERS,
        "attnlab.limits.MAX_LAYERS",
    ),
    **_keys(
        "num_attention_heads n_head num_heads num_key_value_heads num_kv_heads encoder_attention_heads "
        "decoder_attention_heads multi_query_group_num",
        "heads",
        MAX_HEADS,
        "attnlab.limits.MAX_HEADS",
    ),
    **_keys(
        "hidden_size n_embd d_model intermediate_size n_inner d_ff ffn_dim encoder_ffn_dim decoder_ffn_dim "
        "head_dim d_kv kv_channels",
        "a width",
        MAX_MODEL_WIDTH,
        "attnlab.limits.MAX_MODEL_WIDTH",
    ),
    **_keys("vocab_size n_vocab", "a vocabulary", MAX_VOCAB_SIZE, "attnlab.limits.MAX_VOCAB_SIZE"),
    **_keys(
        "max_position_embeddings n_positions n_ctx max_seq_len seq_length original_max_position_embeddings",
        "positions",
        CONTEXT_LENGTH_MAX,
        "attnlab.pretrained.integrity.CONTEXT_LENGTH_MAX",
    ),
}
"""config.json key -> (what it counts, its cap, the cap's name): each a whole number in [0, cap]
(null where transformers allows it), wherever it appears (sub-configs too)."""

FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")
"""The ``dtype`` (``torch_dtype``) values a config.json may declare: attnlab runs float models."""

SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
"""Token ids config.json and generation_config.json name: each an id, or a list of ids (eos).
(``decoder_start_token_id`` is left to transformers, which warns: Marian's config class defaults
it to its own vocabulary's pad id, whatever ``vocab_size`` a folder gives.)"""

_ROPE_COMMON = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})
ROPE_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "axial": frozenset(),
    "proportional": frozenset(),
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "yarn": frozenset(
        {
            "factor",
            "original_max_position_embeddings",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
        }
    ),
    "longrope": frozenset(
        {"short_factor", "long_factor", "original_max_position_embeddings", "attention_factor", "factor"}
    ),
    "llama3": frozenset({"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"}),
}
"""rope type -> the keys it reads beside ``rope_type`` / ``type``, ``rope_theta`` and
``partial_rotary_factor`` (transformers 5's ``_validate_*_rope_parameters``)."""

_BRIDGED_ROPE_KEYS = frozenset(
    {"mrope_section", "mrope_interleaved", "interleaved", "llama_4_scaling_beta", "max_position_embeddings"}
)
"""Keys some of transformers' own models keep in their rope settings (``ignore_keys_at_rope_validation``),
accepted for a folder opened through the bridge."""

_POSITIVE = frozenset(
    {"factor", "rope_theta", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor"}
)
_NON_NEGATIVE = frozenset({"mscale", "mscale_all_dim", "llama_4_scaling_beta"})
_FLAGS = frozenset({"truncate", "mrope_interleaved", "interleaved"})
_FACTOR_LISTS = frozenset({"short_factor", "long_factor"})
_TOP_LEVEL_ROPE = ("rope_theta", "rotary_emb_base", "rope_local_base_freq", "partial_rotary_factor", "rotary_pct")
_DEFAULT_THETA = 10000.0
"""transformers' ``RotaryEmbeddingConfigMixin.default_theta``, where a config gives no base."""
_MERGING_TYPES = ("gemma3_text", "gemma3")
"""Families whose config class merges a legacy ``rope_scaling`` into ``rope_parameters['full_attention']``."""


def check_imported_config(
    config: Mapping[str, Any], where: Path, *, native: bool, generation: Mapping[str, Any] | None = None
) -> None:
    """config.json ``config`` (at ``where``) within attnlab's caps; see the module docstring.

    Args:
        native: opened by attnlab's own family (rope types and keys as attnlab implements them),
            else through the bridge (transformers' model-specific rope keys accepted too).
        generation: the folder's generation_config.json, whose special ids are checked as well.

    Raises:
        CheckpointError: the first value out of its range, naming the file and the key.
    """
    _check_sizes(config, where, prefix="", depth=0)
    for section, prefix in ((config, ""), (config.get("text_config"), "text_config.")):
        if isinstance(section, Mapping):
            _check_dtype(section, where, prefix)
    vocab = _vocabulary(config)
    check_special_ids(config, vocab, where)
    text = config.get("text_config")
    if isinstance(text, Mapping):
        check_special_ids(text, _vocabulary(text) or vocab, where, prefix="text_config.")
    if generation:
        check_special_ids(generation, vocab, where.with_name("generation_config.json"))
    for key in _TOP_LEVEL_ROPE:
        if key in config and config[key] is not None:
            _check_rope_value(key, config[key], where, key)
    rope_settings(config, where, native=native)
    rope_settings(config, where, native=native, layer_type="sliding_attention")


def _check_sizes(config: Mapping[str, Any], where: Path, *, prefix: str, depth: int) -> None:
    for key, value in config.items():
        if isinstance(value, Mapping) and depth < 3:
            _check_sizes(value, where, prefix=f"{prefix}{key}.", depth=depth + 1)
        if key not in SIZE_KEYS or value is None:
            continue
        what, cap, cap_name = SIZE_KEYS[key]
        if isinstance(value, bool) or not isinstance(value, int):
            shown = describe_int(int(value)) if isinstance(value, float) and math.isfinite(value) else repr(value)
            raise CheckpointError(f"{where}: {prefix}{key} must be a whole number ({what}), got {shown}")
        if not 0 <= value <= cap:
            raise CheckpointError(
                f"{where}: {prefix}{key} = {describe_int(value)} is not in [0, {cap:,}], the cap on {what} ({cap_name})"
            )


def _check_dtype(section: Mapping[str, Any], where: Path, prefix: str) -> None:
    for key in ("dtype", "torch_dtype"):
        value = section.get(key)
        if value is None:
            continue
        name = value.removeprefix("torch.") if isinstance(value, str) else value
        if name not in FLOAT_DTYPES:
            raise CheckpointError(
                f"{where}: {prefix}{key} = {value!r} is not a float type; attnlab runs {', '.join(FLOAT_DTYPES)} models"
            )


def _vocabulary(config: Mapping[str, Any]) -> int:
    """The vocabulary config.json declares (``vocab_size``, ``n_vocab``, its text config's), or 0."""
    for section in (config, config.get("text_config")):
        if isinstance(section, Mapping):
            for key in ("vocab_size", "n_vocab"):
                value = section.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
    return 0


def check_special_ids(config: Mapping[str, Any], vocab: int, where: Path, *, prefix: str = "") -> None:
    """Each special id of ``config`` (:data:`SPECIAL_IDS`, an id or a list of them) a whole number
    in [0, ``vocab``) (any non-negative one where ``vocab`` is 0: unknown); ``pad_token_id`` may be
    -1, "none", as Llama 1's configs write it and transformers reads it.

    Raises:
        CheckpointError: the first id outside, naming the file, the key and the vocabulary.
    """
    for key in SPECIAL_IDS:
        value = config.get(key)
        for token in value if isinstance(value, list) else [value]:
            if token is None or (key == "pad_token_id" and token == -1):  # -1: no pad (Llama 1's configs)
                continue
            if isinstance(token, bool) or not isinstance(token, int):
                raise CheckpointError(f"{where}: {prefix}{key} must be a token id (a whole number), got {token!r}")
            if token < 0 or (vocab and token >= vocab):
                inside = (
                    f"[0, {vocab:,}), the model's vocabulary (vocab_size)" if vocab else "[0, ...): ids count from 0"
                )
                raise CheckpointError(f"{where}: {prefix}{key} = {describe_int(token)} is not in {inside}")


def check_tokenizer_fits(tokenizer: Any, vocab: int, path: Path | str) -> None:
    """The tokenizer's ids inside the model's ``vocab`` embedding rows: its vocabulary and the
    special ids its post-processor puts around a text (an id past the rows would fail every
    ``generate``). Added tokens past the rows are not counted: attnlab adds an ``[UNK]`` of its own.

    Args:
        tokenizer: an :class:`attnlab.tokenizers.Tokenizer` (the ids-only stand-in, which has no
            vocabulary, passes).
        vocab: the model's embedding rows (config.json's ``vocab_size``); 0: unknown, not checked.
        path: the tokenizer's file, for the message.

    Raises:
        ConfigError: ids at or past ``vocab``; names tokenizer.json, the ids and the vocabulary.
    """
    backend = getattr(tokenizer, "hf", None)
    if not vocab or backend is None:
        return
    ids = dict(backend.get_vocab(with_added_tokens=False))
    for index in backend.encode("a", add_special_tokens=True).ids:
        ids.setdefault(backend.id_to_token(index) or f"<id {index}>", index)
    beyond = sorted((index, token) for token, index in ids.items() if index >= vocab)
    if beyond:
        shown = ", ".join(f"{token!r} = {index:,}" for index, token in beyond[:3])
        more = f" and {len(beyond) - 3:,} more" if len(beyond) > 3 else ""
        raise ConfigError(
            f"{path}: {len(beyond):,} token id(s) at or past the model's {vocab:,} embedding rows "
            f"(config.json vocab_size): {shown}{more}; the tokenizer does not belong to this model"
        )


_STORED_NAMES = {
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
"""safetensors' names of the non-float dtypes it stores, for the messages."""


def check_stored_float(stored: Any) -> None:
    """A weight of the checkpoint (:class:`attnlab.pretrained.checkpoint.StoredTensor`) stored as
    floats: attnlab converts between float dtypes, never from integers (a quantized tensor).

    Raises:
        CheckpointError: it is stored as integers or booleans; names the file, the tensor and its dtype.
    """
    if not stored.dtype.is_floating_point:
        stored_as = _STORED_NAMES.get(stored.dtype, str(stored.dtype))
        raise CheckpointError(
            f"{stored.shard}: tensor {stored.name!r} is stored as {stored_as}; attnlab reads float weights "
            "(F32, F16, BF16, F64), not quantized or integer ones"
        )


# ---- rope ----------------------------------------------------------------------------------------------


def rope_settings(
    config: Mapping[str, Any], where: Path, *, native: bool = True, layer_type: str = "full_attention"
) -> dict[str, Any]:
    """The rope settings of ``layer_type``'s layers as transformers 5 reads config.json, checked.

    A non-empty legacy ``rope_scaling`` replaces ``rope_parameters`` (Gemma 3: is merged into its
    ``full_attention`` entry); ``rope_theta`` and ``partial_rotary_factor`` at the top level fill
    in what the settings lack. An empty result means no rotary settings were given.

    Raises:
        CheckpointError: a value or key no rope setting has (see the module docstring), or a legacy
            ``rope_scaling`` that would silently drop a ``rope_parameters`` setting; named.
    """
    legacy, params = config.get("rope_scaling"), config.get("rope_parameters")
    for key, value in (("rope_scaling", legacy), ("rope_parameters", params)):
        if value is not None and not isinstance(value, Mapping):
            raise CheckpointError(f"{where}: {key} must be an object of rope settings, got {value!r}")
    if isinstance(legacy, Mapping) and legacy:
        _check_rope_dict(legacy, where, "rope_scaling", native=native)
    nested = isinstance(params, Mapping) and any(isinstance(value, Mapping) for value in params.values())
    if nested:
        for key, value in params.items():
            if value is not None and not isinstance(value, Mapping):
                raise CheckpointError(
                    f"{where}: rope_parameters.{key} must be an object of rope settings (rope_parameters holds "
                    f"one per layer type), got {value!r}"
                )
            if value:
                _check_rope_dict(value, where, f"rope_parameters.{key}", native=native)
        chosen = dict(params.get(layer_type) or {})
    else:
        if params:
            _check_rope_dict(params, where, "rope_parameters", native=native)
        chosen = dict(params or {})
    if legacy:
        if config.get("model_type") in _MERGING_TYPES and nested:
            chosen = {**chosen, **legacy} if layer_type == "full_attention" else chosen
        else:
            _check_replaced(chosen, dict(legacy), config, where)
            chosen = dict(legacy)
    for key in ("rope_theta", "partial_rotary_factor"):
        if key not in chosen and config.get(key) is not None:
            chosen[key] = config[key]
    return chosen


def _check_replaced(params: dict[str, Any], legacy: dict[str, Any], config: Mapping[str, Any], where: Path) -> None:
    """A ``rope_scaling`` that replaces ``rope_parameters`` (transformers 5) must not drop one of
    its settings: the default type is none, a base equal to the one that remains is none."""
    theta = legacy.get("rope_theta", config.get("rope_theta", _DEFAULT_THETA))
    kept = {**legacy, "rope_theta": theta}
    if config.get("partial_rotary_factor") is not None:
        kept.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    kept.setdefault("rope_type", legacy.get("type"))
    for key, value in params.items():
        if key in ("rope_type", "type"):
            if value == "default" or value == kept["rope_type"]:
                continue
            key = "rope_type"
        if key not in kept or kept[key] != value:
            raise CheckpointError(
                f"{where}: rope_scaling (legacy) and rope_parameters disagree on {key} ({kept.get(key)!r} against "
                f"{value!r}); transformers 5 reads rope_scaling alone where both are given and drops "
                "rope_parameters: keep one of them"
            )


def _check_rope_dict(settings: Mapping[str, Any], where: Path, name: str, *, native: bool) -> None:
    kind = settings.get("rope_type", settings.get("type", "default"))
    if not isinstance(kind, str) or kind not in ROPE_KEYS:
        raise CheckpointError(
            f"{where}: {name}.rope_type = {kind!r} is no rope type transformers knows; types: {', '.join(ROPE_KEYS)}"
        )
    allowed = _ROPE_COMMON | ROPE_KEYS[kind] | (frozenset() if native else _BRIDGED_ROPE_KEYS)
    for key, value in settings.items():
        if key not in allowed:
            raise CheckpointError(
                f"{where}: {name}.{key} is no setting of rope type {kind!r}; its settings: "
                f"{', '.join(sorted(allowed - {'type'}))}"
            )
        if key not in ("rope_type", "type"):
            _check_rope_value(key, value, where, f"{name}.{key}")
        elif not isinstance(value, str):
            raise CheckpointError(f"{where}: {name}.{key} must be a name, got {value!r}")


def _check_rope_value(key: str, value: Any, where: Path, name: str) -> None:
    """One rope setting's value: numbers finite and in range, flags true or false, lists of numbers."""
    if key in _FLAGS:
        if not isinstance(value, bool):
            raise CheckpointError(f"{where}: {name} must be true or false, got {value!r}")
        return
    if key in _FACTOR_LISTS or key == "mrope_section":
        if not isinstance(value, list) or len(value) > MAX_MODEL_WIDTH:
            raise CheckpointError(f"{where}: {name} must be a list of numbers, got {value!r:.80}")
        for item in value:
            _check_rope_value("factor" if key in _FACTOR_LISTS else "mrope", item, where, name)
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CheckpointError(f"{where}: {name} must be a number, got {value!r:.80}")
    if key in ("original_max_position_embeddings", "max_position_embeddings", "mrope"):
        low = 0 if key == "mrope" else 1
        if not isinstance(value, int) or not low <= value <= CONTEXT_LENGTH_MAX:
            raise CheckpointError(
                f"{where}: {name} must be a whole number in [{low}, {CONTEXT_LENGTH_MAX:,}], got {value!r}"
            )
        return
    if not math.isfinite(value):
        raise CheckpointError(f"{where}: {name} must be a finite number, got {value!r}")
    if key in ("partial_rotary_factor", "rotary_pct"):
        if not 0 < value <= 1:
            raise CheckpointError(f"{where}: {name} must lie in (0, 1], got {value!r}")
    elif key in _NON_NEGATIVE:
        if value < 0:
            raise CheckpointError(f"{where}: {name} must be >= 0, got {value!r}")
    elif not value > 0:  # factors, bases, betas (and the top-level bases)
        raise CheckpointError(f"{where}: {name} must be a positive number, got {value!r}")
