"""What a model reads from Python: a text, texts, token ids or a batch of them, as one (B, T) batch.

One set of rules for every method of :class:`attnlab.LanguageModel` and every analysis that takes
inputs from Python (the cache, patching, ``test_prompt``):

* a text is framed as the model reads it (``task.encode``: a BOS first where the model wants one);
* a list holds texts or id lists, never both; a list of ints is one example;
* ids lie in the model's vocabulary, and an example fits its context;
* examples of different lengths are padded on the left, so that the last position is every
  example's last token, with ``is_token`` False at the padding.

The (B, T) mask of real tokens is named ``is_token`` everywhere (True = a real token), as the
models of :mod:`attnlab.nn` name it: an *attention mask* in attnlab is the (T_q, T_k) mask of which
keys a query may attend to (``mask``, True = may attend), so Hugging Face's ``attention_mask`` for
padding is not a name here (:func:`takes_is_token`; docs/invariants.md, "The padding mask").
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from attnlab.devices import model_device
from attnlab.errors import UsageError
from attnlab.resources import check_input_text, check_input_tokens
from attnlab.run.loaded import LoadedRun

__all__ = ["model_inputs", "examples", "id_tensor", "left_pad", "check_ids", "check_token_ids", "takes_is_token"]

F = TypeVar("F", bound=Callable[..., Any])


def takes_is_token(function: F) -> F:
    """``function``, which takes the (B, T) real-token mask as ``is_token``, answering a call that
    passes it as Hugging Face's ``attention_mask=`` with one UsageError saying the name (it adds no
    second way to pass the mask)."""

    @functools.wraps(function)
    def checked(*args: Any, **kwargs: Any) -> Any:
        if "attention_mask" in kwargs:
            raise UsageError(
                "attention_mask: the (B, T) padding mask is named is_token here (True = a real token); in "
                "attnlab an attention mask is the (T_q, T_k) mask of the keys each query may attend to"
            )
        return function(*args, **kwargs)

    return checked  # type: ignore[return-value]


def check_token_ids(ids: Tensor, vocabulary: int, what: str) -> None:
    """Raise a UsageError naming ``what`` where an id lies outside 0..vocabulary-1."""
    outside = (ids < 0) | (ids >= vocabulary)
    if bool(outside.any()):
        first = int(ids[outside][0])
        raise UsageError(
            f"{what}: token id {first} is out of range; this model's vocabulary has ids 0..{vocabulary - 1}"
        )


def check_ids(loaded: LoadedRun, ids: list[int], what: str) -> list[int]:
    """``ids`` where each lies in the model's vocabulary and the model's context holds them all."""
    if not ids:
        raise UsageError(f"{what}: no token ids")
    check_token_ids(torch.tensor(ids), loaded.model.config.vocab_size, what)
    check_input_tokens(len(ids), context=loaded.model.config.max_len, what=what)
    return ids


def _kind(item: Any) -> str:
    """``text``, ``ids``, or what the item is, for a message (``list of float``)."""
    if isinstance(item, str):
        return "text"
    if _is_ids(item):
        return "ids"
    if isinstance(item, Sequence):
        return "list of " + "/".join(sorted({type(i).__name__ for i in item}))
    return type(item).__name__


def _is_ids(item: Any) -> bool:
    return isinstance(item, Sequence) and not isinstance(item, str) and all(isinstance(i, int) for i in item)


def examples(
    loaded: LoadedRun, given: Any, what: str = "inputs", encode: Callable[[LoadedRun, str], list[int]] | None = None
) -> list[list[int]]:
    """The examples of ``given``: a text, a list of ids (one example), a list of texts or of id
    lists, or a (T,) or (B, T) tensor of ids (every position a real token).

    Args:
        encode: how a text becomes ids (default the task's ``encode``).

    Raises:
        UsageError: naming ``what``: nothing given, a batch of mixed types, an empty text, an id
        outside the vocabulary, more tokens than the context.
    """
    if isinstance(given, Tensor):
        return id_tensor(loaded, given, what).tolist()
    if isinstance(given, str) or (_is_ids(given) and given):
        given = [given]
    if not isinstance(given, Sequence) or not given:
        raise UsageError(f"{what}: give a text, a list of texts, or token ids (a list or a tensor)")
    kinds = {_kind(item) for item in given}
    if kinds - {"text", "ids"}:
        shown = ", ".join(sorted(kinds - {"text", "ids"}))
        raise UsageError(f"{what}: texts or integer token ids are needed, got {shown} (ids must be ints, not floats)")
    if len(kinds) != 1:
        raise UsageError(f"{what}: a batch of one type is needed (all texts or all id lists), got {sorted(kinds)}")
    encode = encode or (lambda loaded, text: loaded.task.encode(text))
    found = []
    for number, item in enumerate(given):
        where = what if len(given) == 1 else f"{what}[{number}]"
        if isinstance(item, str):
            check_input_text(item, what=where)
            item = encode(loaded, item)
        found.append(check_ids(loaded, list(item), where))
    return found


def id_tensor(loaded: LoadedRun, given: Tensor, what: str = "inputs") -> Tensor:
    """``given``, a (T,) or (B, T) tensor of ids, as (B, T), checked on the tensor itself (integer
    ids of the vocabulary, as many positions as the model's context holds): no copy into lists.

    Raises:
        UsageError: naming ``what``: another dtype or shape, no ids, an id outside the vocabulary,
        more tokens than the context.
    """
    if given.dim() not in (1, 2) or given.is_floating_point() or given.is_complex() or given.dtype == torch.bool:
        shown = f"{given.dtype} {tuple(given.shape)}"
        raise UsageError(f"{what}: integer ids of shape (B, T) or (T,) are needed, got {shown}")
    tokens = given.reshape(-1, given.shape[-1])
    if tokens.numel() == 0:
        raise UsageError(f"{what}: no token ids")
    check_token_ids(tokens, loaded.model.config.vocab_size, what)
    check_input_tokens(tokens.shape[1], context=loaded.model.config.max_len, what=what)
    return tokens


def left_pad(rows: Sequence[list[int]], pad: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(tokens, is_token), both (B, T): ``rows`` padded on the left with ``pad``."""
    width = max(map(len, rows))
    tokens = torch.tensor([[pad] * (width - len(ids)) + ids for ids in rows], device=device)
    is_token = torch.tensor([[False] * (width - len(ids)) + [True] * len(ids) for ids in rows], device=device)
    return tokens, is_token


def model_inputs(
    loaded: LoadedRun, inputs: Any, is_token: Tensor | None = None, what: str = "inputs"
) -> tuple[Tensor, Tensor]:
    """(tokens, is_token), both (B, T) on the model's device, from a text, texts, ids or id lists
    (left-padded with the task's pad id), or a (B, T) tensor of ids with its own ``is_token``.

    Raises:
        UsageError: as :func:`examples`; ``is_token`` given with texts, or of another shape.
    """
    device = model_device(loaded.model)
    if isinstance(inputs, Tensor):
        tokens = id_tensor(loaded, inputs, what)
        if is_token is None:
            return tokens.to(device), torch.ones(tokens.shape, dtype=torch.bool, device=device)
        if is_token.numel() != tokens.numel():
            raise UsageError(f"is_token: shape {tuple(is_token.shape)} does not match the ids' {tuple(tokens.shape)}")
        return tokens.to(device), is_token.reshape(tokens.shape).to(device).bool()
    if is_token is not None:
        raise UsageError("is_token: only with ids as a tensor (texts are padded and masked here)")
    return left_pad(examples(loaded, inputs, what), getattr(loaded.task, "pad_id", 0), device)
