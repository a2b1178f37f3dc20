"""``attnlab.load``: one way in from Python, for any model attnlab opens.

::

    import attnlab
    lm = attnlab.load("gpt2")                       # a run, a model folder, a cached name, a GGUF file
    lm.generate("The capital of France is", max_new_tokens=8)
    with lm.trace("decoder.*.attn.pattern") as t:   # every named site, cached or edited
        lm("When Mary and John went to the store")
    pattern = t.cache["decoder.5.attn.pattern"][0, 1]   # (T_q, T_k) of head 1
    xi = lm.head_mask(); xi["self"][5, 1] = 0.0      # Michel et al.'s xi_h: head 5:1 off
    with attnlab.masking_heads(lm.model, xi):
        lm("When Mary and John went to the store", return_type="loss")
    lm.importance("texts.txt")[:5]                   # the five heads that matter most on a text file
    lm.head_importance(ids)                          # (layers, heads) I_h on a (B, T) batch of ids

:class:`LanguageModel` wraps what :func:`attnlab.pretrained.sources.open_model` opens (a
:class:`attnlab.run.loaded.LoadedRun`): the tokenizer, the model, and the task that says how a text
becomes ids (a BOS first where the model wants one, its chat template). Every analysis of the CLI
takes the same object's ``loaded``; the module is ``lm.model``, a ``torch.nn.Module``.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.analysis.heads import ImportanceRow, TaskProbe, head_importance, importance, scoring_pairs
from attnlab.analysis.lm_probe import NextTokenProbe
from attnlab.analysis.maps import decode_source
from attnlab.devices import model_device
from attnlab.errors import UsageError
from attnlab.generate.sampling import SamplingOptions
from attnlab.generate.search import DecodeOptions, generate_continuations
from attnlab.generate.stream import TextStream
from attnlab.nn import expert_mask_shape, full_head_mask, trace
from attnlab.nn.hooks import Trace
from attnlab.pretrained.placement import PlacementRequest
from attnlab.pretrained.sources import open_model
from attnlab.run.loaded import LoadedRun

__all__ = ["LanguageModel", "load"]


def load(
    source: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    revision: str | None = None,
    verify: bool = True,
    bridge: bool = False,
    device_map: str | dict[str, str] | None = None,
    max_memory: dict[str, int | str] | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
) -> LanguageModel:
    """Open ``source`` (a run directory, a Hugging Face model folder, ``ORG/NAME`` in the local
    Hugging Face cache, or a GGUF file) as a :class:`LanguageModel`.

    Args:
        source: what to open (:mod:`attnlab.pretrained.sources`); nothing is downloaded.
        dtype: ``float32``, ``bfloat16`` or ``float16`` (default: as stored).
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (default: the CPU).
        revision: a snapshot of a cached model (a commit or a ref).
        verify: check the files of a named package or of the Hugging Face cache against their
            known SHA-256 (:mod:`attnlab.pretrained.provenance`; hashes are cached under
            ~/.cache/attnlab, so a second open does not hash again). False opens them unchecked.
        bridge: open a Hugging Face folder through transformers' own modules with attnlab's named
            sites (:mod:`attnlab.pretrained.bridge`) even where attnlab has a native family for it
            (a ``model_type`` without one always opens so), to compare the two paths.
        device_map: place a Hugging Face checkpoint's layers over devices: ``auto``, ``balanced``,
            ``sequential`` or ``{module: device}`` (``cpu``, ``cuda:N``, ``disk``), accelerate's
            conventions (:mod:`attnlab.pretrained.placement`); ``lm.placement`` says where each went.
        max_memory: each device's budget with ``device_map``: ``{"cuda:0": "70GiB", "cpu": "20GiB"}``.
        offload_folder: where the layers no budget holds are written (safetensors) and mapped from.
    """
    placement = PlacementRequest(device_map, max_memory, offload_folder)
    opened = open_model(
        source,
        device=device or "cpu",
        dtype=dtype,
        revision=revision,
        verify=verify,
        bridge=bridge,
        placement=placement,
    )
    return LanguageModel(opened)


class LanguageModel:
    """A model and its tokenizer, with the helpers a TransformerLens or Hugging Face user expects.

    Attributes:
        loaded: what was opened (config, task, tokenizer, model); every CLI analysis takes it.
        model: the ``torch.nn.Module`` (attnlab's ``DecoderOnly`` for a language model).
    """

    def __init__(self, loaded: LoadedRun) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.task = loaded.task
        self.placement = loaded.placement

    def __repr__(self) -> str:
        config = self.model.config
        return (
            f"LanguageModel({self.loaded.name!r}: {config.layers} layers x {config.heads} heads, "
            f"d_model {config.d_model}, {self.dtype}, {self.device})"
        )

    # ---- tokens ------------------------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        """The ids the model reads for ``text`` (with the model's BOS where it puts one first)."""
        return list(self.task.encode(text))

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        """The text of ``ids`` (special tokens dropped)."""
        return self.loaded.codec.decode([int(i) for i in ids])

    def to_str_tokens(self, text_or_ids: str | Sequence[int] | Tensor) -> list[str]:
        """Each token of a text (or of ids) as the string it stands for."""
        ids = self.tokenize(text_or_ids) if isinstance(text_or_ids, str) else [int(i) for i in text_or_ids]
        return [self.loaded.tokenizer.hf.decode([i], skip_special_tokens=False) for i in ids]

    def to_single_token(self, text: str) -> int:
        """The id of ``text`` where it is exactly one token (no BOS); a UsageError otherwise."""
        ids = self.loaded.tokenizer.encode(text)
        if len(ids) != 1:
            raise UsageError(f"{text!r} is {len(ids)} tokens, not one: {self.to_str_tokens(ids)}")
        return ids[0]

    # ---- running ------------------------------------------------------------------------------------

    def __call__(
        self,
        inputs: str | Sequence[str] | Sequence[Sequence[int]] | Tensor,
        attention_mask: Tensor | None = None,
        *,
        return_type: str = "logits",
    ) -> Any:
        """Run the model on one text, several texts (left-padded into a batch) or token ids.

        Args:
            inputs: a text, a list of texts, a list of id lists, or a (B, T) tensor of ids.
            attention_mask: (B, T), 1 or True where a position is a real token (ids only;
                texts are padded and masked here).
            return_type: ``logits``; ``loss`` (the mean next-token cross-entropy over the real
                tokens); or ``both`` (logits, loss). An encoder returns its last hidden states.

        Returns:
            (B, T, V) logits (or hidden states), a scalar loss, or both.
        """
        if return_type not in ("logits", "loss", "both"):
            raise UsageError(f"return_type: unknown {return_type!r}; allowed: logits, loss, both")
        if self.loaded.experiment.model_kind == "encoder_decoder":
            raise UsageError(
                "inputs: an encoder-decoder reads a source and a target: call lm.model(src, tgt_in) on ids, "
                "or lm.generate(text)"
            )
        tokens, is_token = self._batch(inputs, attention_mask)
        logits = self.model(tokens, is_token=is_token)
        if return_type == "logits":
            return logits
        loss = _next_token_loss(logits, tokens, is_token)
        return loss if return_type == "loss" else (logits, loss)

    def _batch(self, inputs: Any, attention_mask: Tensor | None) -> tuple[Tensor, Tensor]:
        device = self.device
        if isinstance(inputs, Tensor):
            tokens = inputs if inputs.dim() == 2 else inputs.unsqueeze(0)
            mask = torch.ones_like(tokens, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
            return tokens.to(device), mask.reshape(tokens.shape).to(device)
        if attention_mask is not None:
            raise UsageError("attention_mask: only with ids as a tensor (texts are padded and masked here)")
        rows = [inputs] if isinstance(inputs, str) else list(inputs)
        ids = [self.tokenize(row) if isinstance(row, str) else [int(i) for i in row] for row in rows]
        if not ids or not all(ids):
            raise UsageError("inputs: nothing to run (no text, or a text of no tokens)")
        width = max(map(len, ids))
        pad = self.task.pad_id
        tokens = torch.tensor([[pad] * (width - len(row)) + row for row in ids], device=device)
        is_token = torch.tensor([[False] * (width - len(row)) + [True] * len(row) for row in ids], device=device)
        return tokens, is_token

    def generate(
        self,
        text: str,
        *,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        chat: bool = False,
        stream: bool = False,
    ) -> str | Iterator[str]:
        """The continuation of ``text``: greedy, or sampled with ``temperature`` > 0 (``top_k``,
        ``top_p``, ``seed``: the same seed gives the same text). With ``chat`` the text is one
        user message in the model's chat template; with ``stream`` an iterator of the pieces of
        text as they are produced."""
        sampling = None
        if temperature > 0:
            sampling = SamplingOptions(
                temperature=temperature, top_k=top_k or 0, top_p=1.0 if top_p is None else top_p, seed=seed
            )
        elif top_k is not None or top_p is not None:
            raise UsageError("top_k, top_p: only when sampling (temperature > 0)")
        options = DecodeOptions(max_length=max_new_tokens, sampling=sampling)
        if self.loaded.experiment.model_kind == "encoder_decoder":  # the output of the source text
            if chat or stream:
                raise UsageError("chat, stream: for a language model; an encoder-decoder writes its output whole")
            written = decode_source(self.loaded, self.loaded.codec.encode(text), options, self.loaded.held_mask())
            return self.decode(written.tokens)
        prompt = self.task.generation_prompt(text, chat=chat)
        if not stream:
            hypothesis = self._continue(prompt, options, on_token=None)
            return self.decode(hypothesis.tokens)
        return self._streamed(prompt, options)

    def _continue(self, prompt: list[int], options: DecodeOptions, on_token: Any) -> Any:
        return generate_continuations(
            self.model,
            [prompt],
            eos_id=self.task.eos_id,
            banned=self.task.generation_banned,
            options=options,
            head_mask=self.loaded.held_mask(),
            on_token=on_token,
        )[0]

    def _streamed(self, prompt: list[int], options: DecodeOptions) -> Iterator[str]:
        """Pieces of text as the tokens arrive: the search runs in a thread, feeding a queue."""
        pieces: queue.Queue[str | BaseException | None] = queue.Queue()
        stream = TextStream(self.loaded.codec.decode)
        eos = self.task.eos_id

        def on_token(token: Tensor) -> None:
            if int(token[0]) != eos:
                pieces.put(stream.push([int(token[0])]))

        def run() -> None:
            try:
                self._continue(prompt, options, on_token)
                pieces.put(stream.finish())
                pieces.put(None)
            except BaseException as error:  # noqa: BLE001 - handed to the reader, who raises it
                pieces.put(error)

        threading.Thread(target=run, daemon=True).start()
        while (piece := pieces.get()) is not None:
            if isinstance(piece, BaseException):
                raise piece
            if piece:
                yield piece

    # ---- observing and intervening ------------------------------------------------------------------

    def trace(
        self,
        cache: str | Sequence[str] | None = None,
        *,
        detach: bool = True,
        device: str | torch.device | None = None,
    ) -> AbstractContextManager[Trace]:
        """:func:`attnlab.trace` on this model: cache or edit its named sites (``attnlab sites``);
        ``device``: where cached tensors are kept (default: each site's layer's device)."""
        return trace(self.model, cache, detach=detach, device=device)

    @property
    def head_mask_shapes(self) -> dict[str, tuple[int, int]]:
        """Head-mask kind -> (layers, heads): the shape of xi (Michel et al. §2) for :func:`attnlab.masking_heads`."""
        return self.model.head_mask_shapes()

    def head_mask(self, value: float = 1.0, *, requires_grad: bool = False) -> dict[str, Tensor]:
        """A head mask xi with every entry ``value`` (1: every head on), on the model's device."""
        return full_head_mask(self.head_mask_shapes, value, requires_grad=requires_grad, device=self.device)

    def expert_mask(self, value: float = 1.0, *, requires_grad: bool = False) -> Tensor:
        """A (layers, experts) mask of a mixture-of-experts model's routing weights, every entry
        ``value``, for :func:`attnlab.masking_experts` (0 at [L, e]: expert e of layer L ablated)."""
        shape = expert_mask_shape(self.model)
        if shape is None:
            raise UsageError(f"expert_mask: {self.loaded.name} has no mixture-of-experts layers")
        return torch.full(shape, float(value), device=self.device, requires_grad=requires_grad)

    def importance(self, texts: str | os.PathLike[str], *, batch_size: int = 16) -> list[ImportanceRow]:
        """Every head ranked by Michel et al.'s I_h = E_x |dL(x)/dxi_h| on a text file (one text
        per line; next-token loss), most important first: one forward and backward pass per batch
        (``attnlab heads importance RUN --texts FILE``). A pretrained encoder-decoder takes
        ``source<TAB>target`` lines (the target's loss given the source; rows of all three kinds)."""
        if self.loaded.experiment.model_kind == "encoder_decoder":
            scored = scoring_pairs(self.loaded, texts)
            rows = importance(TaskProbe(scored, "valid", batch_size=batch_size))
            return sorted(rows, key=lambda row: -row.importance)
        probe = NextTokenProbe(self.loaded, texts, batch_size=batch_size)
        return sorted(importance(probe), key=lambda row: -row.importance)

    def head_importance(self, ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Michel et al.'s I_h = E_x |dL(x)/dxi_h| for every head on a batch of token ids, in one
        forward and one backward pass (only dL/dxi is computed; no task, no texts file).

        L(x) is each row's mean next-token loss over its real tokens, E_x the mean over the rows,
        xi = 1 on the run's held heads' mask (:func:`attnlab.analysis.heads.head_importance`, the
        same computation as :meth:`importance` and ``attnlab heads importance``).

        Args:
            ids: (B, T) token ids as the model reads them (:meth:`tokenize`; a BOS first where
                the model wants one).
            attention_mask: (B, T), 1 or True at real tokens (padding on either side); default all.

        Returns:
            (layers, heads) float64 scores on the CPU; ``[layer, head]`` as in :meth:`head_mask`.
        """
        probe = NextTokenProbe.of_ids(self.loaded, ids, attention_mask)
        scores = head_importance(probe)
        if len(scores) != 1:
            raise UsageError(f"head_importance: a model of one kind of heads is needed, this one has {sorted(scores)}")
        return next(iter(scores.values()))

    # ---- where and how it runs ------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return model_device(self.model)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def to(self, *args: Any, **kwargs: Any) -> LanguageModel:
        """Move or cast the model, as ``torch.nn.Module.to`` (a device, a dtype, or both)."""
        self.model.to(*args, **kwargs)
        return self


def _next_token_loss(logits: Tensor, tokens: Tensor, is_token: Tensor) -> Tensor:
    """Mean cross-entropy of each real token after the first given the ones before it."""
    targets = tokens[:, 1:].masked_fill(~(is_token[:, 1:] & is_token[:, :-1]), -100)
    scores = logits[:, :-1] if logits.dtype in (torch.float32, torch.float64) else logits[:, :-1].float()
    return F.cross_entropy(scores.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
