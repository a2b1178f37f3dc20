"""The documented caps: every count, size and input a person gives has its largest value here.

One place for every limit, each with the reason for its value. Below everything that reads input
(the tokenizers, the tasks, the configs, the CLI), so each of them checks against the same number;
:mod:`attnlab.resources` holds the checks that compare settings with these caps and the memory
estimates, which bound the sizes that have no fixed cap (``model.d_model``, ``model.d_ff``, ...).

A value over a cap is bad input (exit code 2), refused before any work; a valid request that the
machine cannot hold is a :class:`~attnlab.errors.ResourceError` (exit code 4). This module imports
nothing, so that every layer, :mod:`attnlab.errors` included, reads the same numbers.

The caps:

* :data:`MAX_TEXT_CHARS`: characters of one input text (``generate``, ``attention``, ``encode``,
  ``tokenize``, the viewer); after tokenization a text must also fit the model's context.
* :data:`MAX_BEAM`: ``generate --beam``.
* :data:`MAX_NEW_TOKENS`: ``generate --max-new-tokens`` (``--max-length``) / ``attention --max-length``.
* :data:`MAX_SPLIT_EXAMPLES`: ``task.train_size`` and the other split sizes of a synthetic task.
* :data:`MAX_TASK_LENGTH`: ``task.max_train_length``.
* :data:`MAX_VECTOR_DIM`: ``word2vec --dim``.
* :data:`MAX_LAYERS`: ``model.layers`` and ``model.decoder_layers`` (and an imported config's layers).
* :data:`MAX_HEADS`: ``model.heads`` and ``model.kv_heads`` (and an imported config's heads).
* :data:`MAX_MODEL_WIDTH`: an imported config's widths (hidden, intermediate, head size); attnlab's
  own models are bounded by the memory estimate instead.
* :data:`MAX_STEPS`: ``train.steps`` and ``heads prune --retrain-steps``.
* :data:`MAX_EPOCHS`, :data:`MAX_WINDOW`, :data:`MAX_MIN_COUNT`: ``word2vec --epochs``, ``--window``,
  ``--min-count``.
* :data:`MAX_VOCAB_SIZE`: ``tokenize --vocab-size`` (and ``generate --top-k``).
* :data:`MAX_SEED`: every seed (``train.seed``, ``task.seed``, ``--seed``, ``sweep --seeds``): 0 to 2**63 - 1.
* :data:`MAX_BATCH_SIZE`: ``--batch-size`` of ``eval``, ``encode`` and ``heads``.
* :data:`MAX_PROCESSES`: ``--nproc`` (``train``, ``eval --texts``, ``heads importance | ablate |
  detect``) and ``sweep --jobs``.
* :data:`MAX_TEMPERATURE`, :data:`MAX_LENGTH_PENALTY`: ``generate --temperature`` and ``--length-penalty``.
* :data:`MAX_CONFIG_INT`: any integer of a config (a size becomes a tensor dimension, an int64).
* :data:`MAX_INPUT_BYTES`: bytes of one text file a command reads (:func:`attnlab.reading.read_capped`).

Every integer or float option of the command line carries its range (typer's ``min``/``max``) at
parse time, so a value outside it (huge, negative, 5,000 digits) is click's one-line usage error
naming the option, before the command starts; ``tests/integration/test_cli_numeric_options.py``
walks every command so that no option escapes.
"""

from __future__ import annotations

__all__ = [
    "MAX_TEXT_CHARS",
    "MAX_BEAM",
    "MAX_NEW_TOKENS",
    "MAX_SPLIT_EXAMPLES",
    "MAX_VECTOR_DIM",
    "MAX_LAYERS",
    "MAX_HEADS",
    "MAX_MODEL_WIDTH",
    "MAX_TASK_LENGTH",
    "MAX_STEPS",
    "MAX_EPOCHS",
    "MAX_WINDOW",
    "MAX_MIN_COUNT",
    "MAX_VOCAB_SIZE",
    "MAX_SEED",
    "MAX_BATCH_SIZE",
    "MAX_PROCESSES",
    "MAX_TEMPERATURE",
    "MAX_LENGTH_PENALTY",
    "MAX_CONFIG_INT",
    "MAX_INPUT_BYTES",
    "describe_int",
]

MAX_TEXT_CHARS = 20_000
"""Most characters in one input text. Far above any model context here (``max_len`` defaults to
512 tokens); it stops a pasted book before it is tokenized."""

MAX_BEAM = 256
"""Largest beam: each beam row holds its own KV cache, so memory grows linearly with the beam."""

MAX_NEW_TOKENS = 4096
"""Most tokens one decoding may produce (``--max-new-tokens``, ``--max-length``)."""

MAX_SPLIT_EXAMPLES = 1_000_000
"""Most examples in one split of a synthetic task (``task.train_size`` etc.): they are generated and
held in memory before training starts (a few hundred bytes each)."""

MAX_VECTOR_DIM = 65_536
"""Widest word2vec vectors (``word2vec --dim``); model widths here are 16 to 1024."""

MAX_LAYERS = 1024
"""Most layers (``model.layers``, ``model.decoder_layers``); the deepest published Transformers
have about a hundred. Deeper models that would still fit in memory are refused here too."""

MAX_HEADS = 4096
"""Most attention heads in one layer (``model.heads``, ``model.kv_heads``, an imported config's
``num_attention_heads``): published models have at most a few hundred. The query -> key/value head
map holds one entry per head: 10**12 heads once hung while it was built."""

MAX_MODEL_WIDTH = 1 << 20
"""Widest model dimension an imported config may give (``hidden_size``, ``intermediate_size``,
``head_dim`` and their other names): the widest published feed-forward layers are about 75,000
wide. A Hugging Face config.json comes from outside, so its sizes are refused by number before
the model is built; attnlab's own configs are bounded by the memory estimate of
:mod:`attnlab.resources` instead."""

MAX_TASK_LENGTH = 4096
"""Longest ``task.max_train_length`` (symbols or tokens): a synthetic task generates strings up to
twice it (its length-generalisation split), weighs lengths by their number of distinct strings
(numbers of thousands of digits at this length) and holds every string in memory; the models here
read at most a few thousand positions (:data:`MAX_NEW_TOKENS`). 10**12 once hung while generating
the first split, and 65,536 took minutes."""

MAX_STEPS = 10_000_000
"""Most optimizer steps (``train.steps``, ``heads prune --retrain-steps``): 30 times the longest
training in the papers followed here (Vaswani's big model: 300,000 steps); at a millisecond a step,
the smallest model's cost, the cap is already about 3 hours. More is a typo (``1000000000``)."""

MAX_EPOCHS = 10_000
"""Most passes of word2vec over its corpus (``word2vec --epochs``; gensim's default is 5)."""

MAX_WINDOW = 1_000
"""Widest word2vec context, words on each side (``word2vec --window``; usual values are 2 to 10):
each word is paired with up to 2 x window others, so the cost grows with it."""

MAX_MIN_COUNT = 1_000_000_000
"""Largest ``word2vec --min-count``: a corpus is read into memory, so no word occurs a billion times."""

MAX_VOCAB_SIZE = 1_000_000
"""Largest vocabulary a tokenizer may be trained to (``tokenize --vocab-size``); the largest
published vocabularies hold about 256,000 tokens. The trainers allocate per token id up front: a
vocabulary of 10**12 aborted the process in the tokenizers library's allocator."""

MAX_SEED = 2**63 - 1
"""Largest seed (seeds are 0 to 2**63 - 1): ``torch.manual_seed`` and ``torch.Generator`` take a
64-bit integer; one range for every seed, whichever library it reaches."""

MAX_BATCH_SIZE = 65_536
"""Most examples in one forward pass of ``eval``, ``encode`` and ``heads`` (``--batch-size``):
activations grow with it; larger batches gain nothing on these models."""

MAX_PROCESSES = 256
"""Most processes one command starts (``--nproc``, ``sweep --jobs``): each holds a copy of
the model and a Python interpreter; no machine here has more cores."""

MAX_TEMPERATURE = 100.0
"""Highest sampling temperature (``generate --temperature``): at 100 every token of logits within
+-10 of each other is drawn with probability within 20% of uniform; more is a typo."""

MAX_LENGTH_PENALTY = 100.0
"""Largest beam-search length penalty exponent (``generate --length-penalty``; Wu et al. use 0.6 to 1)."""

MAX_CONFIG_INT = 2**63 - 1
"""Largest magnitude of any integer in a config (``--set`` or TOML): sizes become tensor dimensions
and seeds 64-bit integers; a larger number is refused naming its key instead of overflowing inside
PyTorch (keys with their own cap, such as :data:`MAX_LAYERS`, are checked against it too)."""

MAX_INPUT_BYTES = 64 * 2**20
"""Most bytes of one text input read from a file or stdin (``eval --texts``, ``tokenize --train``,
``word2vec`` corpora, ``--pairs``, ...): 64 MiB of text, far more than any task corpus here. The
file is read through :func:`attnlab.reading.read_capped`, which stops at the cap: ``/dev/zero`` is refused at
once instead of filling the memory."""


def describe_int(value: int) -> str:
    """``value`` for a message: ``1,000`` as is; one too long to print usefully by its digit count."""
    digits = len(str(abs(value))) if abs(value) < 10**4000 else None
    if digits is not None and digits <= 30:
        return f"{value:,}"
    return f"a number of {digits:,} digits" if digits is not None else "a number of over 4,000 digits"
