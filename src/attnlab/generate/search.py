"""Greedy and beam-search decoding over the KV cache, for EncoderDecoder and DecoderOnly.

Decoding produces y_1, y_2, ... one token at a time: at test time the decoder input is
(y_1, ..., y_{l-1}, ∅, ..., ∅) (Li's slides, "Transformer Architecture"; Agarwal §5.2). With the KV
cache each step feeds only the newest token: self-attention appends its keys and values to the
cache, and encoder-decoder attention projects the encoder output once per source. Without the cache
each step re-runs the whole prefix; both give the same tokens.

A *stepper* hides the model kind: ``next_logits(prefix)`` gives the logits of the next token for
each row, and ``reorder(index)`` selects rows (beam search). Greedy search and beam search are
written once, over steppers.

Which ids are never predicted is the caller's choice (``banned``): the tasks attnlab trains ban PAD
and BOS; a pretrained LM bans nothing (SmolLM2's PAD id *is* its EOS). A finished row keeps being
fed EOS (never PAD), so no padding ever enters the target side and the cached and uncached paths see
identical inputs; a decoder-only model is told that every position is a real token, so its padding
id is never recognised by value.

Sampling (:func:`sample_search`) draws each token from the model's distribution reshaped by
:mod:`attnlab.generate.sampling`. Draws come from a ``torch.Generator`` seeded by the caller, never
from the global RNG, so the same seed gives the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from attnlab.devices import model_device
from attnlab.errors import UsageError
from attnlab.generate.sampling import SamplingOptions, warp_logits
from attnlab.kernels.linear import packed_weights
from attnlab.limits import MAX_BEAM, MAX_LENGTH_PENALTY, MAX_NEW_TOKENS
from attnlab.nn import DecoderOnly, EncodedSource, EncoderDecoder, HeadMask, masking_heads

__all__ = [
    "DecodeOptions",
    "OnToken",
    "Hypothesis",
    "Stepper",
    "EncoderDecoderStepper",
    "DecoderOnlyStepper",
    "greedy_search",
    "sample_search",
    "beam_search",
    "decode",
    "generate_continuations",
]


OnToken = Callable[[Tensor], None]
"""Called after every decoding step with that step's tokens, (B,) (finished rows repeat EOS)."""


@dataclass(frozen=True)
class DecodeOptions:
    """How to decode.

    Attributes:
        max_length: most new tokens per sequence (EOS included).
        beam_size: 1 for greedy search (or sampling), more for beam search.
        length_penalty: alpha in score / length^alpha (0 = raw log-probability).
        use_cache: feed one token a step through the KV cache (else re-run the prefix).
        sampling: draw tokens (:func:`sample_search`) instead of searching; None or a temperature
            of 0 = greedy. Only with ``beam_size`` 1.
    """

    max_length: int = 64
    beam_size: int = 1
    length_penalty: float = 1.0
    use_cache: bool = True
    sampling: SamplingOptions | None = None

    def __post_init__(self) -> None:
        """Raises UsageError naming the option outside its range (the command line's ranges)."""
        counts = (("max_length", self.max_length, MAX_NEW_TOKENS), ("beam_size", self.beam_size, MAX_BEAM))
        for name, value, most in counts:
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most:
                raise UsageError(f"{name}: must be an integer in [1, {most:,}], got {value!r}")
        penalty = self.length_penalty
        if not isinstance(penalty, (int, float)) or isinstance(penalty, bool) or not 0 <= penalty <= MAX_LENGTH_PENALTY:
            raise UsageError(f"length_penalty: must lie in [0, {MAX_LENGTH_PENALTY:g}], got {penalty!r}")
        if self.samples and self.beam_size > 1:
            raise UsageError("sampling: only with beam_size 1 (beam search does not sample)")

    @property
    def samples(self) -> bool:
        """Whether tokens are drawn (a sampling temperature above 0)."""
        return self.sampling is not None and not self.sampling.greedy


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

    def __init__(self, model: EncoderDecoder, src: Tensor, *, use_cache: bool, positions: Tensor | None = None) -> None:
        self.model = model
        self.memory: EncodedSource = model.encode(src)
        self.state = model.new_state() if use_cache else None
        if positions is not None:
            if self.state is None:
                raise ValueError("positions: planned decoder positions need the KV cache (use_cache)")
            self.state.positions = positions

    def next_logits(self, prefix: Tensor) -> Tensor:
        if self.state is None:
            return self.model.decode(prefix, self.memory)[:, -1]
        new = prefix[:, len(self.state) :]
        return self.model.decode(new, self.memory, state=self.state)[:, -1]

    def reorder(self, index: Tensor) -> None:
        self.memory = self.memory.reorder(index)
        if self.state is not None:
            self.state.reorder(index)


class DecoderOnlyStepper:
    """Steps a :class:`DecoderOnly` model; the prefix is the prompt plus what was generated."""

    def __init__(self, model: DecoderOnly, *, use_cache: bool, prompt_is_token: Tensor | None = None) -> None:
        self.model = model
        self.state = model.new_state() if use_cache else None
        self.prompt_is_token = prompt_is_token  # (B, t0): False at a left-padded prompt's padding

    def next_logits(self, prefix: Tensor) -> Tensor:
        # Every position after the prompts' padding is a real token: say so, since a model's
        # padding id may be a real token too (SmolLM2's PAD is its EOS).
        start = 0 if self.state is None else len(self.state)
        new = prefix[:, start:]
        is_token = torch.ones(prefix.shape, dtype=torch.bool, device=new.device)
        if self.prompt_is_token is not None:
            is_token[:, : self.prompt_is_token.shape[1]] = self.prompt_is_token
        return self.model(new, state=self.state, is_token=is_token[:, start:])[:, -1]

    def reorder(self, index: Tensor) -> None:
        if self.state is not None:
            self.state.reorder(index)
        if self.prompt_is_token is not None:
            self.prompt_is_token = self.prompt_is_token[index]


def _forbid(logits: Tensor, banned: Sequence[int]) -> Tensor:
    if not banned:
        return logits
    logits = logits.clone()
    logits[:, list(banned)] = float("-inf")
    return logits


TokenPicker = Callable[[Tensor], Tensor]
"""(R, V) log-probabilities of the next token -> (R,) the tokens chosen."""


@torch.inference_mode()
@packed_weights()  # every step reads the same weights: oneDNN's packed copies, dropped at the end
def greedy_search(
    stepper: Stepper,
    prefix: Tensor,
    *,
    eos_id: int,
    banned: Sequence[int],
    max_length: int,
    on_token: OnToken | None = None,
) -> list[Hypothesis]:
    """Pick the most probable token at every step, for every row at once.

    Args:
        on_token: called with each step's tokens as soon as they are chosen (streaming).

    Shape:
        prefix: (B, t0), the start of every row (BOS, or a prompt).
    """
    return _step_by_step(
        stepper, prefix, _most_probable, eos_id=eos_id, banned=banned, max_length=max_length, on_token=on_token
    )


def _most_probable(log_probs: Tensor) -> Tensor:
    return log_probs.argmax(-1)


@torch.inference_mode()
@packed_weights()  # every step reads the same weights: oneDNN's packed copies, dropped at the end
def sample_search(
    stepper: Stepper,
    prefix: Tensor,
    *,
    eos_id: int,
    banned: Sequence[int],
    max_length: int,
    sampling: SamplingOptions,
    on_token: OnToken | None = None,
) -> list[Hypothesis]:
    """Draw every token from the model's distribution reshaped by ``sampling`` (:func:`warp_logits`).

    A hypothesis's ``log_prob`` is the model's own log-probability of the drawn tokens (banned
    ids removed, before temperature and filters), as in greedy search. A temperature of 0 is greedy
    search.

    Args:
        on_token: called with each step's tokens as soon as they are drawn (streaming).

    Shape:
        prefix: (B, t0), the start of every row.
    """
    if sampling.greedy:
        return greedy_search(stepper, prefix, eos_id=eos_id, banned=banned, max_length=max_length, on_token=on_token)
    generator = torch.Generator(device=prefix.device)
    if sampling.seed is None:
        generator.seed()
    else:
        generator.manual_seed(sampling.seed)

    def draw(log_probs: Tensor) -> Tensor:
        probs = warp_logits(log_probs, sampling).softmax(dim=-1)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]

    return _step_by_step(stepper, prefix, draw, eos_id=eos_id, banned=banned, max_length=max_length, on_token=on_token)


def _step_by_step(
    stepper: Stepper,
    prefix: Tensor,
    pick: TokenPicker,
    *,
    eos_id: int,
    banned: Sequence[int],
    max_length: int,
    on_token: OnToken | None,
) -> list[Hypothesis]:
    """One token per row per step, chosen by ``pick``, until every row has ended or ``max_length``."""
    batch = prefix.shape[0]
    finished = torch.zeros(batch, dtype=torch.bool, device=prefix.device)
    log_probs = torch.zeros(batch, dtype=torch.float64, device=prefix.device)
    new_tokens = []
    for _ in range(max_length):
        step_log_probs = torch.log_softmax(_forbid(stepper.next_logits(prefix).float(), banned), dim=-1)
        token = pick(step_log_probs)
        token = torch.where(finished, torch.full_like(token, eos_id), token)
        log_probs += torch.where(finished, 0.0, step_log_probs.gather(-1, token[:, None])[:, 0].double())
        new_tokens.append(token)
        if on_token is not None:
            on_token(token)
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
@packed_weights()  # every step reads the same weights: oneDNN's packed copies, dropped at the end
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
    positions: Tensor | None = None,
    banned: Sequence[int] | None = None,
) -> list[Hypothesis]:
    """Decode a padded batch of sources with an :class:`EncoderDecoder` (optionally with heads masked).

    Args:
        positions: the decoder's positions for BOS and the tokens it writes, in order
            (randomized-position evaluation, :func:`attnlab.nn.token_positions.planned_positions`);
            default 0, 1, ...
        banned: ids never written; default ``pad_id`` and ``bos_id`` (a task's
            ``generation_banned`` where it has one: a pretrained model's distribution is taken
            as it is). EOS is never banned (BART's decoder starts from its EOS).

    Shape:
        src: (B, T_src), padded with ``pad_id``;  positions: (B, T_p).
    """
    with _evaluation_mode(model), masking_heads(model, head_mask):
        stepper = EncoderDecoderStepper(model, src, use_cache=options.use_cache, positions=positions)
        prefix = torch.full((src.shape[0], 1), bos_id, dtype=torch.long, device=src.device)
        banned = (pad_id, bos_id) if banned is None else banned
        return _search(stepper, prefix, eos_id=eos_id, banned=[b for b in banned if b != eos_id], options=options)


def generate_continuations(
    model: DecoderOnly,
    prompts: Sequence[Sequence[int]],
    *,
    eos_id: int,
    banned: Sequence[int],
    options: DecodeOptions = DecodeOptions(),
    device: torch.device | str | None = None,
    head_mask: HeadMask | None = None,
    on_token: OnToken | None = None,
    pad_id: int | None = None,
) -> list[Hypothesis]:
    """Continue each prompt with a :class:`DecoderOnly` model.

    Prompts of equal length are decoded together; prompts of different lengths go in separate
    batches, so that no padding shifts a position (absolute positions start at 0 in every row),
    or with ``pad_id`` all in one batch, left-padded and masked (the model counts each row's
    positions from its first real token, so a row continues as it does alone, up to rounding).

    Args:
        banned: ids never produced (a trained task's PAD and BOS; nothing for a pretrained LM).
        options: greedy, beam or sampling (``options.sampling``).
        on_token: called with each step's tokens, (B,) of the batch being decoded (greedy and
            sampling only; streaming one prompt at a time).
        pad_id: the id written at padded positions, to decode prompts of different lengths together.
    """
    device = model_device(model) if device is None else device
    results: list[Hypothesis | None] = [None] * len(prompts)
    by_length: dict[int, list[int]] = {}
    for index, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {index} is empty: give at least a BOS token")
        by_length.setdefault(len(prompt) if pad_id is None else 0, []).append(index)
    with _evaluation_mode(model), masking_heads(model, head_mask):
        for indices in by_length.values():
            width = max(len(prompts[i]) for i in indices)
            rows = [[pad_id] * (width - len(prompts[i])) + list(prompts[i]) for i in indices]
            prefix = torch.tensor(rows, dtype=torch.long, device=device)
            is_token = torch.tensor([[i >= width - len(prompts[j]) for i in range(width)] for j in indices])
            padded = None if bool(is_token.all()) else is_token.to(device)
            stepper = DecoderOnlyStepper(model, use_cache=options.use_cache, prompt_is_token=padded)
            found = _search(stepper, prefix, eos_id=eos_id, banned=banned, options=options, on_token=on_token)
            for index, hypothesis in zip(indices, found):
                results[index] = hypothesis
    return [r for r in results if r is not None]


@contextmanager
def _evaluation_mode(model: torch.nn.Module) -> Iterator[None]:
    """Decode without dropout or autograd (the encoder pass too), with the weights packed for the
    whole generation (:func:`attnlab.kernels.linear.packed_weights`), then give the model back in
    the mode it came in."""
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode(), packed_weights():
            yield
    finally:
        model.train(was_training)


def _search(
    stepper: Stepper,
    prefix: Tensor,
    *,
    eos_id: int,
    banned: Sequence[int],
    options: DecodeOptions,
    on_token: OnToken | None = None,
) -> list[Hypothesis]:
    if options.samples:
        assert options.sampling is not None
        return sample_search(
            stepper,
            prefix,
            eos_id=eos_id,
            banned=banned,
            max_length=options.max_length,
            sampling=options.sampling,
            on_token=on_token,
        )
    if options.beam_size == 1:
        return greedy_search(
            stepper, prefix, eos_id=eos_id, banned=banned, max_length=options.max_length, on_token=on_token
        )
    return beam_search(
        stepper,
        prefix,
        eos_id=eos_id,
        banned=banned,
        max_length=options.max_length,
        beam_size=options.beam_size,
        length_penalty=options.length_penalty,
    )
