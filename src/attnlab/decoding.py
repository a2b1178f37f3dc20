"""Greedy and beam-search decoding over the KV cache, for EncoderDecoder and DecoderOnly.

Decoding produces y_1, y_2, ... one token at a time: at test time the decoder input is
(y_1, ..., y_{l-1}, ∅, ..., ∅) (Li's slides, "Transformer Architecture"; Agarwal §5.2). With the KV
cache each step feeds only the newest token: self-attention appends its keys and values to the
cache, and encoder-decoder attention projects the encoder output once per source. Without the cache
each step re-runs the whole prefix; both give the same tokens.

A *stepper* hides the model kind: ``next_logits(prefix)`` gives the logits of the next token for
each row, and ``reorder(index)`` selects rows (beam search). Greedy search and beam search are
written once, over steppers.

PAD and BOS are never predicted. A finished row keeps being fed EOS (never PAD), so no padding ever
enters the target side and the cached and uncached paths see identical inputs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from attnlab.devices import model_device
from attnlab.nn import DecoderOnly, EncodedSource, EncoderDecoder, HeadMask

__all__ = [
    "DecodeOptions",
    "Hypothesis",
    "Stepper",
    "EncoderDecoderStepper",
    "DecoderOnlyStepper",
    "greedy_search",
    "beam_search",
    "decode",
    "generate_continuations",
]


@dataclass(frozen=True)
class DecodeOptions:
    """How to decode.

    Attributes:
        max_length: most new tokens per sequence (EOS included).
        beam_size: 1 for greedy search, more for beam search.
        length_penalty: alpha in score / length^alpha (0 = raw log-probability).
        use_cache: feed one token a step through the KV cache (else re-run the prefix).
    """

    max_length: int = 64
    beam_size: int = 1
    length_penalty: float = 1.0
    use_cache: bool = True

    def __post_init__(self) -> None:
        if self.max_length < 1:
            raise ValueError(f"max_length: must be >= 1, got {self.max_length}")
        if self.beam_size < 1:
            raise ValueError(f"beam_size: must be >= 1, got {self.beam_size}")
        if self.length_penalty < 0:
            raise ValueError(f"length_penalty: must be >= 0, got {self.length_penalty}")


@dataclass(frozen=True)
class Hypothesis:
    """One decoded sequence: its tokens (without BOS, up to and without EOS) and its log-probability."""

    tokens: list[int]
    log_prob: float
    finished: bool


class Stepper(Protocol):
    def next_logits(self, prefix: Tensor) -> Tensor:
        """prefix: (R, t) tokens so far (BOS first); returns (R, V) logits of token t+1."""
        ...

    def reorder(self, index: Tensor) -> None:
        """Keep rows ``index`` (R',) of every per-row state."""
        ...


class EncoderDecoderStepper:
    """Steps an :class:`EncoderDecoder` over one encoded source batch."""

    def __init__(
        self, model: EncoderDecoder, src: Tensor, *, use_cache: bool, head_mask: HeadMask | None = None
    ) -> None:
        self.model, self.head_mask = model, head_mask
        self.memory: EncodedSource = model.encode(src, head_mask=head_mask)
        self.state = model.new_state() if use_cache else None

    def next_logits(self, prefix: Tensor) -> Tensor:
        if self.state is None:
            return self.model.decode(prefix, self.memory, head_mask=self.head_mask)[:, -1]
        new = prefix[:, len(self.state) :]
        return self.model.decode(new, self.memory, head_mask=self.head_mask, state=self.state)[:, -1]

    def reorder(self, index: Tensor) -> None:
        self.memory = self.memory.reorder(index)
        if self.state is not None:
            self.state.reorder(index)


class DecoderOnlyStepper:
    """Steps a :class:`DecoderOnly` model; the prefix is the prompt plus what was generated."""

    def __init__(self, model: DecoderOnly, *, use_cache: bool, head_mask: HeadMask | None = None) -> None:
        self.model, self.head_mask = model, head_mask
        self.state = model.new_state() if use_cache else None

    def next_logits(self, prefix: Tensor) -> Tensor:
        if self.state is None:
            return self.model(prefix, head_mask=self.head_mask)[:, -1]
        return self.model(prefix[:, len(self.state) :], head_mask=self.head_mask, state=self.state)[:, -1]

    def reorder(self, index: Tensor) -> None:
        if self.state is not None:
            self.state.reorder(index)


def _forbid(logits: Tensor, banned: Sequence[int]) -> Tensor:
    logits = logits.clone()
    logits[:, list(banned)] = float("-inf")
    return logits


@torch.inference_mode()
def greedy_search(
    stepper: Stepper, prefix: Tensor, *, eos_id: int, banned: Sequence[int], max_length: int
) -> list[Hypothesis]:
    """Pick the most probable token at every step, for every row at once.

    Shape:
        prefix: (B, t0), the start of every row (BOS, or a prompt).
    """
    batch = prefix.shape[0]
    finished = torch.zeros(batch, dtype=torch.bool, device=prefix.device)
    log_probs = torch.zeros(batch, dtype=torch.float64, device=prefix.device)
    new_tokens = []
    for _ in range(max_length):
        step_log_probs = torch.log_softmax(_forbid(stepper.next_logits(prefix).float(), banned), dim=-1)
        token = step_log_probs.argmax(-1)
        token = torch.where(finished, torch.full_like(token, eos_id), token)
        log_probs += torch.where(finished, 0.0, step_log_probs.gather(-1, token[:, None])[:, 0].double())
        new_tokens.append(token)
        finished |= token == eos_id
        prefix = torch.cat([prefix, token[:, None]], dim=1)
        if bool(finished.all()):
            break
    generated = torch.stack(new_tokens, 1).tolist()
    return [_hypothesis(row, float(lp), eos_id) for row, lp in zip(generated, log_probs.tolist())]


def _hypothesis(tokens: list[int], log_prob: float, eos_id: int) -> Hypothesis:
    if eos_id in tokens:
        return Hypothesis(tokens[: tokens.index(eos_id)], log_prob, True)
    return Hypothesis(tokens, log_prob, False)


@torch.inference_mode()
def beam_search(
    stepper: Stepper,
    prefix: Tensor,
    *,
    eos_id: int,
    banned: Sequence[int],
    max_length: int,
    beam_size: int,
    length_penalty: float,
) -> list[Hypothesis]:
    """Keep the ``beam_size`` best prefixes per row; finished hypotheses are ranked by
    log p / length^alpha. Returns the best hypothesis of each row.

    A row stops when ``beam_size`` hypotheses have ended and its best open beam, normalised at
    the current length, cannot beat the worst of them (the stopping rule of Hugging Face's default
    ``early_stopping=False``; with alpha > 0 a longer continuation could still score higher). A
    stopped row is frozen while the other rows go on, so a padded batch decodes exactly like each
    row alone.

    Shape:
        prefix: (B, t0).
    """
    batch, k = prefix.shape[0], beam_size
    device = prefix.device
    rows = torch.arange(batch, device=device).repeat_interleave(k)  # (B*K,) beam r -> its batch row
    stepper.reorder(rows)
    prefix = prefix[rows]  # (B*K, t0)
    scores = torch.full((batch, k), float("-inf"), dtype=torch.float64, device=device)
    scores[:, 0] = 0.0  # all beams start identical: keep one alive so they do not duplicate
    finished: list[list[tuple[float, list[int], float]]] = [[] for _ in range(batch)]
    done = [False] * batch
    start = prefix.shape[1]

    def normalized(log_prob: float, length: int) -> float:
        return log_prob / (max(1, length) ** length_penalty)

    for step in range(1, max_length + 1):
        step_log_probs = torch.log_softmax(_forbid(stepper.next_logits(prefix).float(), banned), dim=-1).double()
        vocab = step_log_probs.shape[-1]
        candidates = (scores.unsqueeze(-1) + step_log_probs.view(batch, k, vocab)).view(batch, k * vocab)
        top_scores, top_index = candidates.topk(min(2 * k, k * vocab), dim=-1)  # (B, 2K)
        next_beam = torch.zeros(batch, k, dtype=torch.long, device=device)
        next_token = torch.full((batch, k), eos_id, dtype=torch.long, device=device)
        next_scores = torch.full((batch, k), float("-inf"), dtype=torch.float64, device=device)
        for b in range(batch):
            if done[b]:  # frozen: its beams stay at -inf and add nothing
                continue
            kept = 0
            for score, index in zip(top_scores[b].tolist(), top_index[b].tolist()):
                if score == float("-inf") or kept == k:
                    break
                beam, token = divmod(index, vocab)
                if token == eos_id:
                    tokens = prefix[b * k + beam, start:].tolist()
                    finished[b].append((normalized(score, step), tokens, score))
                    continue
                next_beam[b, kept], next_token[b, kept], next_scores[b, kept] = beam, token, score
                kept += 1
        done = [done[b] or _row_done(finished[b], next_scores[b], step, k, normalized) for b in range(batch)]
        if all(done):
            break
        index = (torch.arange(batch, device=device)[:, None] * k + next_beam).view(-1)  # (B*K,)
        stepper.reorder(index)
        prefix = torch.cat([prefix[index], next_token.view(-1, 1)], dim=1)
        scores = next_scores
    results = []
    for b in range(batch):
        if finished[b]:
            _, tokens, log_prob = max(finished[b], key=lambda item: item[0])  # the first of equals
            results.append(Hypothesis(tokens, log_prob, True))
        else:  # nothing ended within max_length: return the best open beam
            best = int(scores[b].argmax())
            results.append(Hypothesis(prefix[b * k + best, start:].tolist(), float(scores[b, best]), False))
    return results


def _row_done(finished, open_scores: Tensor, step: int, k: int, normalized) -> bool:  # noqa: ANN001
    """Done when k hypotheses ended and no open beam can still beat the worst kept one."""
    if len(finished) < k:
        return False
    best_open = float(open_scores.max())
    if best_open == float("-inf"):
        return True
    worst_kept = sorted(item[0] for item in finished)[-k]
    return normalized(best_open, step) <= worst_kept  # log-probs only fall as sequences grow (exact for alpha = 0)


def decode(
    model: EncoderDecoder,
    src: Tensor,
    *,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    options: DecodeOptions = DecodeOptions(),
    head_mask: HeadMask | None = None,
) -> list[Hypothesis]:
    """Decode a padded batch of sources with an :class:`EncoderDecoder` (optionally with heads masked).

    Shape:
        src: (B, T_src), padded with ``pad_id``.
    """
    with _evaluation_mode(model):
        stepper = EncoderDecoderStepper(model, src, use_cache=options.use_cache, head_mask=head_mask)
        prefix = torch.full((src.shape[0], 1), bos_id, dtype=torch.long, device=src.device)
        return _search(stepper, prefix, eos_id=eos_id, banned=(pad_id, bos_id), options=options)


def generate_continuations(
    model: DecoderOnly,
    prompts: Sequence[Sequence[int]],
    *,
    eos_id: int,
    banned: Sequence[int],
    options: DecodeOptions = DecodeOptions(),
    device: torch.device | str | None = None,
    head_mask: HeadMask | None = None,
) -> list[Hypothesis]:
    """Continue each prompt with a :class:`DecoderOnly` model.

    Prompts of equal length are decoded together; prompts of different lengths go in separate
    batches, so that no padding shifts a position (absolute positions start at 0 in every row).
    """
    device = model_device(model) if device is None else device
    results: list[Hypothesis | None] = [None] * len(prompts)
    by_length: dict[int, list[int]] = {}
    for index, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {index} is empty: give at least a BOS token")
        by_length.setdefault(len(prompt), []).append(index)
    with _evaluation_mode(model):
        for indices in by_length.values():
            prefix = torch.tensor([list(prompts[i]) for i in indices], dtype=torch.long, device=device)
            stepper = DecoderOnlyStepper(model, use_cache=options.use_cache, head_mask=head_mask)
            found = _search(stepper, prefix, eos_id=eos_id, banned=banned, options=options)
            for index, hypothesis in zip(indices, found):
                results[index] = hypothesis
    return [r for r in results if r is not None]


@contextmanager
def _evaluation_mode(model: torch.nn.Module) -> Iterator[None]:
    """Decode without dropout or autograd (the encoder pass too), then give the model back in the
    mode it came in."""
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        model.train(was_training)


def _search(
    stepper: Stepper, prefix: Tensor, *, eos_id: int, banned: Sequence[int], options: DecodeOptions
) -> list[Hypothesis]:
    if options.beam_size == 1:
        return greedy_search(stepper, prefix, eos_id=eos_id, banned=banned, max_length=options.max_length)
    return beam_search(
        stepper,
        prefix,
        eos_id=eos_id,
        banned=banned,
        max_length=options.max_length,
        beam_size=options.beam_size,
        length_penalty=options.length_penalty,
    )
