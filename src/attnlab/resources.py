"""Bounded resources: settings checked against the caps, and memory estimates, before any work.

An input or setting whose cost grows without bound (a 100,000-character text, ten thousand layers,
a batch of a billion) is refused here, before a model is built or a run directory is created, with
one :class:`~attnlab.errors.UsageError` or :class:`~attnlab.errors.ConfigError` (exit code 2) that
names the flag or key and says what to do. The caps themselves, each with its reason, are in
:mod:`attnlab.limits`; ``train.batch_size`` is capped by the number of training examples.

Sizes of models are not capped by a number but by a memory estimate (:func:`training_memory`,
:func:`word2vec_memory`) compared with the memory the machine has free (:func:`available_memory`);
an estimate above it is a :class:`~attnlab.errors.ResourceError` (exit code 4: the request is valid,
this machine cannot hold it), where a value over a cap is a usage error (exit code 2).
The estimate is deliberately simple and on the high side for short sequences; it exists to turn
"allocator error after 47 s" or "swapping for an hour" into an immediate, explained refusal, not to
predict the peak to the megabyte.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from attnlab.errors import ConfigError, ResourceError, UsageError
from attnlab.limits import (
    MAX_LAYERS,
    MAX_SPLIT_EXAMPLES,
    MAX_TASK_LENGTH,
    MAX_TEXT_CHARS,
    MAX_VECTOR_DIM,
)

__all__ = [
    "SPLIT_SIZE_KEYS",
    "MemoryEstimate",
    "check_input_text",
    "check_input_tokens",
    "check_decode_length",
    "FIXED_POSITIONS",
    "check_split_sizes",
    "check_length_bins_fit",
    "check_batch_size",
    "check_vector_dim",
    "check_layers",
    "longest_sequence",
    "check_training_resources",
    "parameter_count",
    "training_memory",
    "word2vec_memory",
    "available_memory",
    "check_memory",
    "gib",
]

SPLIT_SIZE_KEYS = ("train_size", "valid_size", "test_size", "length_generalisation_size")
"""The [task] keys that set how many examples a split generates."""

BYTES_PER_FLOAT = 4
TRAINING_BYTES_PER_PARAMETER = 16
"""fp32 weight, its gradient and Adam's two moments: 4 x 4 bytes."""

BUFFER_BUILD_FACTOR = 4
"""Bytes a buffer takes while it is built, per byte kept: a sinusoidal table is computed in float64
(its angles, the zeroed table, sin and cos) before it is rounded to float32."""

WORD2VEC_COPIES = 3
"""gensim's input vectors and negative-sampling output vectors, plus attnlab's float32 copy."""


# ---- input texts --------------------------------------------------------------------------------


def check_input_text(text: str, *, what: str = "TEXT", cap: int = MAX_TEXT_CHARS) -> None:
    """Refuse an empty (or all-whitespace) text, or one longer than ``cap`` characters.

    Args:
        text: the input as given.
        what: how the person gave it (``TEXT``, ``--text``, "line 3 of texts.txt"), for the message.
        cap: most characters (default :data:`MAX_TEXT_CHARS`).

    Raises:
        UsageError: naming ``what``, the length and the cap.
    """
    if not text.strip():
        raise UsageError(f"{what}: empty input; give some text (e.g. symbols of the task such as abcd)")
    if len(text) > cap:
        raise UsageError(
            f"{what}: {len(text):,} characters, more than the cap of {cap:,} (attnlab.limits.MAX_TEXT_CHARS); "
            "shorten the input or split it into several texts"
        )


def check_input_tokens(count: int, *, context: int, what: str = "TEXT") -> None:
    """Refuse a tokenized input longer than the model's context.

    Args:
        count: positions the input takes, specials included.
        context: the model's context, ``model.max_len``.
        what: how the person gave the input, for the message.
    """
    if count > context:
        raise UsageError(
            f"{what}: {count:,} tokens, longer than the model's context of {context:,} (model.max_len); "
            "shorten the input"
        )


# ---- decoding -----------------------------------------------------------------------------------


FIXED_POSITIONS = ("learned", "gehring_joint", "gehring_sum")
"""Positional encodings with one table row per position: no position past ``model.max_len`` exists.
(Sinusoidal positions extrapolate; ``none`` has no positions.)"""


def check_decode_length(prompt: int, new: int, *, config, context: int | None = None) -> int:  # noqa: ANN001
    """The most new tokens a decoding may produce: ``new``, or fewer where the model's positions end.

    A model with fixed positions (:data:`FIXED_POSITIONS`) has none past ``model.max_len``, so its
    decoding stops there (as it would at EOS) instead of failing mid-way; a prompt that leaves no
    position at all is refused. A ``context`` the task sets (a pretrained LM's ``max_tokens``, the
    length it was trained on) caps decoding the same way, whatever its positions.

    Args:
        prompt: positions the decoder side holds before the first new token (BOS, plus the prompt
            of a language model).
        new: most new tokens asked for (``--max-new-tokens``).
        config: the model's :class:`attnlab.nn.TransformerConfig`.
        context: the task's context (``task.max_tokens``), or None when only the model's positions limit it.

    Raises:
        UsageError: the prompt already fills every position.
    """
    if context is not None:
        limit, origin = context, "task.max_tokens"
    elif config.positional in FIXED_POSITIONS:
        limit, origin = config.max_len, f"model.max_len, {config.positional} positions"
    else:
        return new
    room = limit - prompt
    if room < 1:
        raise UsageError(
            f"TEXT: {prompt:,} positions leave no room to generate in the model's context of {limit:,} "
            f"({origin}); shorten the input"
        )
    return min(new, room)


# ---- training data ------------------------------------------------------------------------------


def check_split_sizes(task: dict, *, section: str = "task") -> None:
    """Refuse a split size above :data:`~attnlab.limits.MAX_SPLIT_EXAMPLES`, or a
    ``max_train_length`` above :data:`~attnlab.limits.MAX_TASK_LENGTH`, in a [task] section."""
    length = task.get("max_train_length")
    if isinstance(length, int) and not isinstance(length, bool) and length > MAX_TASK_LENGTH:
        raise ConfigError(
            f"{section}.max_train_length: {length:,}, more than the cap of {MAX_TASK_LENGTH:,} "
            "(attnlab.limits.MAX_TASK_LENGTH); lower it"
        )
    for key in SPLIT_SIZE_KEYS:
        value = task.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_SPLIT_EXAMPLES:
            raise ConfigError(
                f"{section}.{key}: {value:,} examples, more than the cap of {MAX_SPLIT_EXAMPLES:,} "
                "(attnlab.limits.MAX_SPLIT_EXAMPLES); lower it"
            )


def check_batch_size(batch_size: int, examples: int, *, key: str = "train.batch_size") -> None:
    """Refuse a batch larger than the training split: every step would be the whole split, which
    is not what the number asks for and usually a typo."""
    if batch_size > examples:
        raise ConfigError(
            f"{key}: {batch_size:,} is larger than the training split ({examples:,} examples); "
            f"lower it to at most {examples:,}"
        )


def check_vector_dim(dim: int, *, flag: str = "--dim") -> None:
    """Refuse word vectors wider than :data:`MAX_VECTOR_DIM` (or narrower than 1)."""
    if not 1 <= dim <= MAX_VECTOR_DIM:
        raise ConfigError(f"{flag}: must lie in [1, {MAX_VECTOR_DIM:,}] (attnlab.limits.MAX_VECTOR_DIM), got {dim:,}")


def check_layers(config) -> None:  # noqa: ANN001
    """Refuse more than :data:`MAX_LAYERS` layers (encoder or decoder) in a model config."""
    for name in ("layers", "decoder_layers"):
        value = getattr(config, name, None)
        if value is not None and value > MAX_LAYERS:
            raise ConfigError(
                f"model.{name}: {value:,} layers, more than the cap of {MAX_LAYERS:,} "
                "(attnlab.limits.MAX_LAYERS); lower it"
            )


def longest_sequence(examples: Iterable) -> int:  # noqa: ANN001  (attnlab.tasks.base.Example)
    """The most positions one example takes: its source, or BOS + its target."""
    longest = 0
    for example in examples:
        target = len(example.target) + 1 if example.target is not None else 0
        longest = max(longest, len(example.source), target)
    return longest


def check_training_resources(
    config,
    *,
    batch_size: int,
    examples: Sequence,
    max_length: int,  # noqa: ANN001
    available: int | None = None,
) -> MemoryEstimate:
    """Everything about a training run's size that can be refused before the model exists.

    Checks the layer cap, that the batch is not larger than the training split, that randomized
    positions (``model.randomized_positions = M``) can place the longest example, and that
    :func:`training_memory` of the model on batches of ``batch_size`` sequences as long as the longest
    training example (at most ``max_length``) fits in the available memory.

    Args:
        config: the model's config (from :func:`attnlab.experiment.model_config_for_task`).
        batch_size: ``train.batch_size``.
        examples: the training split.
        max_length: the longest sequence training feeds (``train.max_length`` or ``model.max_len``).
        available: bytes free; default :func:`available_memory`.

    Returns:
        The memory estimate that was accepted.
    """
    check_layers(config)
    if not examples:
        raise ConfigError("the task's train split is empty: nothing to train on")
    check_batch_size(batch_size, len(examples))
    seq_len = max(1, min(max_length, longest_sequence(examples)))
    _check_randomized_positions(config, seq_len)
    estimate = training_memory(config, batch_size=batch_size, seq_len=seq_len)
    check_memory(
        estimate,
        what=f"training this model (batches of {batch_size} x {seq_len} tokens)",
        reduce=("model.layers", "model.d_model", "model.d_ff", "train.batch_size", "model.max_len"),
        available=available,
    )
    return estimate


def _check_randomized_positions(config, seq_len: int) -> None:  # noqa: ANN001
    """Randomized positions draw T distinct positions from [0, M): M must cover the longest sequence."""
    limit = getattr(config, "randomized_positions", None)
    if limit and seq_len > limit:
        raise ConfigError(
            f"model.randomized_positions: M={limit} is smaller than the longest training sequence "
            f"({seq_len} positions); set it to at least {seq_len}"
        )


# ---- memory -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a piece of work is expected to hold at its peak.

    Attributes:
        parameters: how many model parameters (or vector entries).
        parameter_bytes: bytes for the parameters and what is kept per parameter (gradients, Adam).
        activation_bytes: bytes for activations kept for the backward pass.
    """

    parameters: int
    parameter_bytes: int
    activation_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.parameter_bytes + self.activation_bytes


def gib(n_bytes: float) -> str:
    """``n_bytes`` in GiB, for messages (``"12.3 GiB"``; ``"1.8e+11 GiB"`` beyond a million)."""
    value = n_bytes / 2**30
    return f"{value:,.1f} GiB" if value < 1e6 else f"{value:.2g} GiB"


def parameter_count(config) -> int:  # noqa: ANN001  (a TransformerConfig; torch imported lazily)
    """The number of parameters of the model ``config`` describes, without allocating it: the model
    is built on PyTorch's ``meta`` device (shapes only, no memory), so every option counts exactly
    (score functions with parameters, pruned layers, grouped-query attention, gated FFNs).

    Args:
        config: a :class:`attnlab.nn.TransformerConfig` (any kind).

    Returns:
        The parameter count (tied parameters once). A model whose tensors PyTorch cannot even
        describe (a size past 2**63 bytes) gets a lower bound, its attention maps alone, which
        the memory check refuses anyway.
    """
    return _meta_sizes(config)[0]


def _meta_sizes(config) -> tuple[int, int]:  # noqa: ANN001
    """``(parameters, buffer bytes)`` of the model ``config`` describes, built on the ``meta``
    device (see :func:`parameter_count`). Buffers are the tables a model computes rather than
    learns (sinusoidal positions of ``model.max_len`` rows, rotary caches): 10**8 positions once
    passed the estimate and then exhausted the memory."""
    # Imported here: the CLI imports this module for its checks, and its help pages load no torch.
    import torch

    from attnlab.nn import build_model

    try:
        with torch.device("meta"):
            model = build_model(config)
    except RuntimeError:  # "Storage size calculation overflowed"
        return 4 * config.layers * config.d_model**2, 0
    buffers = sum(buffer.numel() * buffer.element_size() for buffer in model.buffers())
    return model.num_parameters(), BUFFER_BUILD_FACTOR * buffers


def _activation_floats_per_token(config, seq_len: int) -> int:  # noqa: ANN001
    """Floats kept for the backward pass per token position, summed over layers (see training_memory)."""
    d, f, heads, T = config.d_model, config.d_ff, config.heads, seq_len
    layer = 12 * d + 2 * f + 3 * heads * T
    cross = 6 * d + 3 * heads * T
    layers = config.layers * layer + config.cross_attention_layers * (layer + cross)
    return layers + 3 * config.logits_per_position


def training_memory(config, *, batch_size: int, seq_len: int) -> MemoryEstimate:  # noqa: ANN001
    """Peak memory of training ``config`` with Adam in fp32 on batches of ``batch_size`` x ``seq_len``.

    Parameters: 16 bytes each (:data:`TRAINING_BYTES_PER_PARAMETER`: the fp32 weight, its gradient,
    and Adam's first and second moments).

    Activations, in bytes, with B = batch_size, T = seq_len, L layers, H heads, V the output
    vocabulary::

        4 * B * T * (L * (12 d + 2 d_ff + 3 H T) + 3 V)

    Per token and layer, autograd keeps about 12 d floats around attention and the residual
    paths (the layer input, Q, K, V, the concatenated heads, the output projection, the dropout
    masks and the two LayerNorms' inputs and outputs), 2 d_ff in the feed-forward network (the hidden
    layer before and after its activation) and 3 H T in attention (the scores, the softmax weights
    and their dropout or gradient: one T-vector per head). A decoder layer's cross-attention adds
    6 d + 3 H T. The output layer keeps the logits, their log-softmax and its gradient: 3 V per
    token. Gradients of activations live one layer at a time and are not counted.

    Args:
        config: the model's :class:`attnlab.nn.TransformerConfig`.
        batch_size: examples per step (B).
        seq_len: the longest sequence in a batch (T), specials included.

    Returns:
        The estimate; compare it with :func:`available_memory` through :func:`check_memory`.
    """
    parameters, buffer_bytes = _meta_sizes(config)
    activations = BYTES_PER_FLOAT * batch_size * seq_len * _activation_floats_per_token(config, seq_len)
    return MemoryEstimate(parameters, TRAINING_BYTES_PER_PARAMETER * parameters + buffer_bytes, activations)


def word2vec_memory(vocab_size: int, dim: int) -> MemoryEstimate:
    """Memory of skip-gram word2vec: ``vocab_size x dim`` float32 values, :data:`WORD2VEC_COPIES` times
    (gensim's input and output vectors, and the float32 copy attnlab returns)."""
    entries = vocab_size * dim
    return MemoryEstimate(entries, WORD2VEC_COPIES * BYTES_PER_FLOAT * entries, 0)


def available_memory() -> int:
    """Bytes of memory this machine can give a new allocation now.

    ``MemAvailable`` of ``/proc/meminfo`` (Linux: free memory plus reclaimable caches); elsewhere
    the free physical pages (``os.sysconf``), or the total when that is not known either.
    """
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    page = _sysconf("SC_PAGE_SIZE")
    pages = _sysconf("SC_AVPHYS_PAGES") or _sysconf("SC_PHYS_PAGES")
    return page * pages if page and pages else 2**63 - 1


def _sysconf(name: str) -> int:
    try:
        return int(os.sysconf(name))
    except (AttributeError, ValueError, OSError):
        return 0


def check_memory(
    estimate: MemoryEstimate,
    *,
    what: str,
    reduce: Sequence[str] | Iterable[str],
    available: int | None = None,
    error: type[Exception] = ResourceError,
) -> None:
    """Refuse work whose estimated peak memory exceeds the memory available.

    Args:
        estimate: from :func:`training_memory` or :func:`word2vec_memory`.
        what: the work, for the message (``"training this model"``).
        reduce: the keys or flags that lower the estimate, named in the message.
        available: bytes free; default :func:`available_memory`.
        error: the class to raise (default :class:`~attnlab.errors.ResourceError`, exit code 4: the
            request is valid, this machine cannot hold it).
    """
    free = available_memory() if available is None else available
    if estimate.total_bytes > free:
        raise error(
            f"{what} needs about {gib(estimate.total_bytes)} of memory ({estimate.parameters:,} parameters: "
            f"{gib(estimate.parameter_bytes)}; activations: {gib(estimate.activation_bytes)}), more than the "
            f"{gib(free)} this machine has available; reduce {', '.join(reduce)}"
        )


def check_length_bins_fit(task: object, max_length: int) -> None:
    """Refuse length bins (``task.eval_lengths``), and the lengths of depth bins (``task.eval_depths``),
    longer than the model reads, before training: a string of n symbols takes n + 1 positions (EOS,
    or BOS for a decoder)."""
    bins = getattr(task, "length_bins", {})
    longest = max((high for _, high in bins.values()), default=0) + 1
    if bins and longest > max_length:
        raise ConfigError(
            f"task.eval_lengths: the longest bin needs {longest} positions, more than the model's "
            f"max_length={max_length}; raise model.max_len (or train.max_length) or shorten the bins"
        )
    if getattr(task, "depth_bins", {}) and task.depth_bin_lengths().stop > max_length:  # type: ignore[attr-defined]
        raise ConfigError(
            f"task.eval_depths: the depth bins' longest strings need {task.depth_bin_lengths().stop} positions, "  # type: ignore[attr-defined]
            f"more than the model's max_length={max_length}; raise model.max_len (or train.max_length) or set "
            "task.eval_depth_lengths"
        )
