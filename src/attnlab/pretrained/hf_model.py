"""A Hugging Face checkpoint opened as an attnlab model, in memory: nothing converted on disk.

:func:`open_checkpoint` reads config.json through the family's mapping
(:mod:`attnlab.pretrained.families`), builds attnlab's ``DecoderOnly`` with its parameters
allocated but untouched, and fills them from the safetensors files one tensor at a time, in the
stored dtype (bf16 stays bf16) unless ``dtype`` asks otherwise. The weights are held once; the
checkpoint's files are only read.

The tokenizer is the folder's ``tokenizer.json``; the special ids come from config.json,
generation_config.json and tokenizer_config.json (in that order of precedence for the end of
sequence, as Hugging Face's ``generate`` takes generation_config.json's), the chat template from
tokenizer_config.json or ``chat_template.jinja``, and whether a BOS is put before each text from
the tokenizer's own post-processor (what ``AutoTokenizer`` does with ``add_special_tokens``).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from attnlab.errors import CheckpointError, ConfigError
from attnlab.experiment import ExperimentConfig, model_for_task
from attnlab.nn import TransformerModel
from attnlab.pretrained.bridge import BridgedLM, empty_transformers_model, load_transformers_model
from attnlab.pretrained.bridge_seq2seq import BridgedSeq2Seq
from attnlab.pretrained.checkpoint import Checkpoint, read_tensors
from attnlab.pretrained.config_checks import check_imported_config, check_tokenizer_fits
from attnlab.pretrained.families import FAMILIES, family_of
from attnlab.pretrained.integrity import check_chat_template, check_model_section
from attnlab.pretrained.layout import check_mapped, fill_state, take_weights
from attnlab.pretrained.placement import Placement, PlacementRequest, dispatch, offload, plan
from attnlab.pretrained.provenance import check_sources, remember_values_checked, values_checked
from attnlab.tasks.base import Task
from attnlab.tasks.registry import build_task
from attnlab.tokenizers import IdsOnlyTokenizer, Tokenizer

__all__ = ["OpenedCheckpoint", "open_checkpoint", "checkpoint_tokenizer", "task_section"]


@dataclass(frozen=True)
class OpenedCheckpoint:
    """A checkpoint as attnlab's experiment (task and model sections), task, tokenizer and model."""

    checkpoint: Checkpoint
    experiment: ExperimentConfig
    task: Task
    tokenizer: Tokenizer
    model: TransformerModel
    placement: Placement | None = None
    """Where the model's modules are, where it was placed over devices (None: on one device)."""


def open_checkpoint(
    checkpoint: Checkpoint,
    *,
    dtype: torch.dtype | None = None,
    verify: bool = True,
    bridge: bool = False,
    placement: PlacementRequest = PlacementRequest(),
    on_plan: Callable[[Placement], None] | None = None,
) -> OpenedCheckpoint:
    """The model of ``checkpoint`` with its weights, in ``dtype`` (default: as stored), on the CPU, in eval mode.

    Args:
        verify: check the files of a Hugging Face cache snapshot against their blobs' SHA-256
            (:func:`attnlab.pretrained.provenance.check_sources`; hashes are cached).
        bridge: open it through transformers' own modules (:mod:`attnlab.pretrained.bridge`) even
            where attnlab has a native family for its ``model_type`` (to compare the two paths).
        placement: where its layers go (:mod:`attnlab.pretrained.placement`): planned before any
            weight is read, then each tensor assembled straight onto its device, one placed module at
            a time (a disk module written to the offload folder and mapped back before the next).
        on_plan: called with the plan before any weight is read (the CLI prints it).

    Raises:
        ConfigError: a ``model_type``, rope scaling or config key attnlab does not implement, or a
            tokenizer whose ids reach past the model's vocabulary (named).
        CheckpointError: a config.json value outside attnlab's caps
            (:mod:`attnlab.pretrained.config_checks`), a tensor missing, unexpected, misshapen or
            stored as integers, or a damaged file (named).
    """
    check_sources(checkpoint.files(), verify=verify)
    where = checkpoint.folder / "config.json"
    bridged = bridge or checkpoint.config.get("model_type") not in FAMILIES  # transformers' own modules
    generation = checkpoint.json_file("generation_config.json")
    check_imported_config(checkpoint.config, where, native=not bridged, generation=generation)
    if bridged:
        return _open_bridged(checkpoint, dtype, placement, on_plan)
    family = family_of(checkpoint.config, where)
    try:
        model_section = family.model_section(checkpoint.config, where)
    except (KeyError, TypeError, ValueError) as error:
        raise ConfigError(f"{where}: {error}") from None
    check_model_section(model_section, path=where)
    tokenizer = checkpoint_tokenizer(checkpoint)
    experiment = ExperimentConfig(task=task_section(checkpoint, tokenizer), model=model_section)
    task, _ = build_task(experiment.task, saved_tokenizer=tokenizer)
    try:
        model = model_for_task(experiment, task, to_load=True)
    except ValueError as error:
        raise ConfigError(f"{where}: {error}") from None
    layout = family.layout(checkpoint.config, model_section["tie_embeddings"])
    expected = model.state_dict()
    sources = list(read_tensors(checkpoint))  # names and spans only: nothing read yet
    stored = _stored_dtype(sources)
    planned = plan(model, placement, dtype=dtype or stored) if placement.wanted else None
    if planned is not None:
        check_mapped(
            (n for n, _ in sources), layout, checkpoint.config, ignored=family.ignored, where=checkpoint.folder
        )
        if on_plan is not None:
            on_plan(planned)
    check_values = not all(values_checked(shard) for shard in checkpoint.shards)
    state: dict[str, torch.Tensor] = {}
    for unit, names in _units(model, expected, planned).items():  # one decoder layer at a time where placed
        targets = [name for name in names if name in layout]
        pieces = {piece.name for target in targets for piece in layout[target]}
        part = fill_state(
            sources if planned is None else [(n, t) for n, t in sources if n in pieces],
            {name: expected[name] for name in targets},
            {name: layout[name] for name in targets},
            checkpoint.config,
            dtype=dtype or stored,  # one dtype for every weight, whatever each was stored in
            ignored=family.ignored,
            where=checkpoint.folder,
            check_values=check_values,
        )
        for name in [n for n in names if _zeroed(n, family.zeros)]:
            part[name] = torch.zeros(expected[name].shape, dtype=dtype or stored)
        state.update(part if planned is None else _placed(unit, part, planned))
    if check_values:
        for shard in checkpoint.shards:
            remember_values_checked(shard)
    take_weights(model, state)
    if planned is not None:
        dispatch(model, planned)
    opened = OpenedCheckpoint(checkpoint, experiment, task, tokenizer, model.eval())
    return dataclasses.replace(opened, placement=planned)


def _stored_dtype(sources: list[tuple[str, Any]]) -> torch.dtype:
    """The checkpoint's floating dtype: the one most of its float bytes are stored in (a tensor
    stored in another float dtype, F64 among F32 ones, is converted to it on reading, as
    transformers converts it to the config's dtype); float32 where it has no float tensor."""
    sizes: dict[torch.dtype, int] = {}
    for _, stored in sources:
        if stored.dtype.is_floating_point:
            sizes[stored.dtype] = sizes.get(stored.dtype, 0) + stored.nbytes
    return max(sizes, key=sizes.__getitem__) if sizes else torch.float32


def _zeroed(name: str, zeros: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, zero) for zero in zeros)


def _units(
    model: TransformerModel, expected: dict[str, torch.Tensor], planned: Placement | None
) -> dict[str, list[str]]:
    """The model's tensors by the module they are assembled with: one decoder layer at a time, or
    the placed module around them ("" for all of them without a placement)."""
    if planned is None:
        return {"": list(expected)}
    layer_ids = {id(layer) for stack, _ in model.site_stacks().values() for layer in stack.layers}
    layers = [name for name, module in model.named_modules() if id(module) in layer_ids]
    units: dict[str, list[str]] = {}
    for name in expected:
        placed = planned.unit_of(name)
        layer = next((prefix for prefix in layers if name.startswith(prefix + ".")), "")
        units.setdefault(layer if len(layer) > len(placed) else placed, []).append(name)
    return units


def _placed(unit: str, part: dict[str, torch.Tensor], planned: Placement) -> dict[str, torch.Tensor]:
    """One placed module's tensors on its device: a GPU's copy, the CPU's, or mapped back from the
    offload folder (written now, then the module's copies dropped)."""
    device = planned.device_of(unit)
    if device == "disk":
        assert planned.offload_folder is not None  # plan() refuses the disk without a folder
        return offload(unit, {name: t.contiguous() for name, t in part.items()}, planned.offload_folder) if part else {}
    return part if device == "cpu" else {name: t.to(device) for name, t in part.items()}


def _open_bridged(
    checkpoint: Checkpoint,
    dtype: torch.dtype | None,
    placement: PlacementRequest = PlacementRequest(),
    on_plan: Callable[[Placement], None] | None = None,
) -> OpenedCheckpoint:
    """A causal LM or an encoder-decoder of a ``model_type`` attnlab has no family for, through
    transformers' own modules with attnlab's sites (:mod:`attnlab.pretrained.bridge`,
    :mod:`attnlab.pretrained.bridge_seq2seq`); placed over devices by transformers' own dispatch,
    on the plan :func:`attnlab.pretrained.placement.plan` makes first on the empty model."""
    where = checkpoint.folder / "config.json"
    seq2seq = check_bridged_type(checkpoint.config, where)
    tokenizer = checkpoint_tokenizer(checkpoint)
    task_options = task_section(checkpoint, tokenizer, seq2seq=seq2seq)
    planned = None
    if placement.wanted:
        empty, no_split = empty_transformers_model(checkpoint.folder, seq2seq=seq2seq)
        stored = _stored_dtype(list(read_tensors(checkpoint)))
        planned = plan(empty, placement, dtype=dtype or stored, no_split=no_split)
        if on_plan is not None:
            on_plan(planned)
    hf = load_transformers_model(checkpoint.folder, dtype=dtype, seq2seq=seq2seq, placement=planned)
    model = (BridgedSeq2Seq if seq2seq else BridgedLM)(hf, pad_id=task_options["pad"])
    model_section = {key: value for key, value in model.config.to_dict().items() if key not in _DECIDED}
    experiment = ExperimentConfig(task=task_options, model=model_section)
    task, _ = build_task(experiment.task, saved_tokenizer=tokenizer)
    return OpenedCheckpoint(checkpoint, experiment, task, tokenizer, model.eval(), planned)


_DECIDED = ("vocab_size", "tgt_vocab_size", "pad_id")
"""What the task decides of a model section (its vocabulary, its padding id)."""


def check_bridged_type(config: dict[str, Any], where: Any) -> bool:
    """Whether config.json's ``model_type`` is an encoder-decoder (transformers' seq2seq mapping)
    rather than a causal language model; a ConfigError where transformers knows it as neither (or
    it is not installed: the ``bridge`` extra). A type of both mappings (BART, Marian, ...) is an
    encoder-decoder unless the folder holds the decoder alone (``is_decoder``, or its
    ``architectures`` are ``*ForCausalLM``)."""
    model_type, auto_map = config.get("model_type"), config.get("auto_map")
    try:
        from transformers.models.auto.modeling_auto import (  # lazy: transformers is imported only by the bridge
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
            MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        )
    except ImportError:
        raise ConfigError(
            f"{where}: model_type {model_type!r} has no native family ({', '.join(sorted(FAMILIES))}); "
            "opening it through transformers' modules needs transformers: pip install 'attnlab[bridge]'"
        ) from None

    architectures = config.get("architectures") or []
    decoder_alone = bool(config.get("is_decoder")) or (
        bool(architectures) and all(str(name).endswith("ForCausalLM") for name in architectures)
    )
    if model_type in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES and not decoder_alone:
        return True
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return False
    if isinstance(model_type, str) and isinstance(auto_map, dict) and auto_map:
        raise ConfigError(
            f"{where}: model_type {model_type!r} comes with its own code (auto_map: {', '.join(map(str, auto_map))}); "
            "attnlab never runs a folder's code (trust_remote_code)"
        )
    raise ConfigError(
        f"{where}: model_type {model_type!r} is no causal language model or encoder-decoder transformers knows "
        f"(attnlab's own families: {', '.join(sorted(FAMILIES))})"
    )


# ---- the tokenizer and the special ids --------------------------------------------------------------


def checkpoint_tokenizer(checkpoint: Checkpoint) -> Tokenizer:
    """The folder's tokenizer.json, or the fast tokenizer transformers converts from its other
    files (``tokenizer.model``, ``vocab.json`` + ``merges.txt``); with none of them, a stand-in
    that labels ids and refuses text, naming what is missing (the model runs on token ids).

    Raises:
        ConfigError: a tokenizer whose ids reach past config.json's ``vocab_size`` (named).
    """
    path = checkpoint.file("tokenizer.json")
    vocab = _vocab_size(checkpoint.config)
    if path is None and (converted := _converted_tokenizer(checkpoint)) is not None:
        check_tokenizer_fits(converted, vocab, checkpoint.folder)
        return converted
    if path is None and vocab:
        return IdsOnlyTokenizer(
            vocab,
            f"{checkpoint.folder}: no tokenizer (tokenizer.json, tokenizer.model, or vocab.json + merges.txt), "
            "so no text can be read: give token ids (a (B, T) tensor, or lists of ints)",
        )
    if path is None:
        raise CheckpointError(
            f"{checkpoint.folder}: no tokenizer.json (attnlab reads the fast tokenizer's file; save one with "
            "AutoTokenizer.from_pretrained(folder).save_pretrained(folder))"
        )
    tokenizer = Tokenizer.load(path)
    check_tokenizer_fits(tokenizer, vocab, path)
    return tokenizer


def _vocab_size(config: dict[str, Any]) -> int:
    """config.json's vocabulary size (its text config's for a composite model), or 0."""
    for section in (config, config.get("text_config") or {}):
        value = section.get("vocab_size") if isinstance(section, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= 1 << 24:
            return value
    return 0


def _converted_tokenizer(checkpoint: Checkpoint) -> Tokenizer | None:
    """transformers' conversion of a slow tokenizer's files to a fast one (its ``tokenizers`` JSON)."""
    if not any(checkpoint.file(name) for name in ("tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")):
        return None
    try:
        from transformers import AutoTokenizer  # lazy: only for folders without tokenizer.json

        converted = AutoTokenizer.from_pretrained(checkpoint.folder, local_files_only=True, trust_remote_code=False)
    except Exception as error:  # noqa: BLE001 - transformers' failure, said in one line
        raise CheckpointError(f"{checkpoint.folder}: its tokenizer files could not be converted: {error}") from None
    backend = getattr(converted, "backend_tokenizer", None)
    return None if backend is None else Tokenizer.from_str(backend.to_str(), source=checkpoint.folder)


def task_section(checkpoint: Checkpoint, tokenizer: Tokenizer, *, seq2seq: bool = False) -> dict[str, Any]:
    """The task of a checkpoint: ``pretrained_lm`` (its context, special ids, chat template,
    vocabulary), or with ``seq2seq`` ``pretrained_seq2seq`` (the decoder's start id besides)."""
    config = checkpoint.config
    generation = checkpoint.json_file("generation_config.json")
    settings = checkpoint.json_file("tokenizer_config.json")
    bos = _first_id(generation.get("bos_token_id", config.get("bos_token_id")))
    eos = _first_id(generation.get("eos_token_id", config.get("eos_token_id")))
    if eos is None:
        eos = _named_id(tokenizer, settings.get("eos_token"))
    if eos is None:
        raise ConfigError(f"{checkpoint.folder / 'config.json'}: no eos_token_id (nor in generation_config.json)")
    pad = _first_id(generation.get("pad_token_id", config.get("pad_token_id")))
    vocab = int(config.get("vocab_size") or config.get("n_vocab") or 0)
    common = {
        "max_tokens": int(
            config.get("max_position_embeddings") or config.get("n_positions") or (512 if seq2seq else 2048)
        ),
        "eos": eos,
        "pad": eos if pad is None or (vocab and pad >= vocab) else pad,
        "model_vocab": vocab,
    }
    adds_bos = bos is not None and _adds_bos(tokenizer, bos)
    if seq2seq:  # without a start id the decoder starts from EOS (mBART's shift of its labels)
        start = _first_id(generation.get("decoder_start_token_id", config.get("decoder_start_token_id")))
        return {
            "name": "pretrained_seq2seq",
            **common,
            "start": eos if start is None else start,
            "bos": bos if adds_bos else -1,
        }
    return {
        "name": "pretrained_lm",
        **common,
        "bos": -1 if bos is None else bos,
        "add_bos": adds_bos,
        "chat_template": _chat_template(checkpoint, settings),
    }


def _first_id(value: Any) -> int | None:
    """A token id, or the first of a list of them (Llama 3 Instruct ends on either of two)."""
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _named_id(tokenizer: Tokenizer, token: Any) -> int | None:
    if isinstance(token, dict):
        token = token.get("content")
    return tokenizer.token_to_id(token) if isinstance(token, str) else None


def _adds_bos(tokenizer: Tokenizer, bos: int) -> bool:
    """Whether the tokenizer's post-processor puts ``bos`` before a text (as ``AutoTokenizer`` does)."""
    ids = tokenizer.hf.encode("a", add_special_tokens=True).ids
    return bool(ids) and ids[0] == bos


def _chat_template(checkpoint: Checkpoint, settings: dict[str, Any]) -> str:
    template = settings.get("chat_template")
    if isinstance(template, list):  # several named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    path = checkpoint.file("chat_template.jinja")
    if not isinstance(template, str):
        template = path.read_text(encoding="utf-8") if path is not None else ""
    where = checkpoint.folder / "tokenizer_config.json" if isinstance(settings.get("chat_template"), str) else path
    if template:
        check_chat_template(template, path=where or checkpoint.folder, field="chat_template")
    return template
