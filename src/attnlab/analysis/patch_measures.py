"""What activation patching measures, by model kind: how a text or ids become a batch, and the
metric m of a batch of outputs (higher = more like the clean run).

A *batch* of patching is B clean/corrupt pairs (each pair of as many tokens); the metric of a run
is the mean of m over the B examples, as TransformerLens' and Wang et al.'s (2023) IOI analyses
average the logit difference over their prompts. A language model's examples may differ in
length: they are left-padded, so that the last position is every example's last token.

:data:`RUNNERS` is the registry of model kinds; :func:`language_model_measure` the named metrics
of a language model (:data:`METRICS`), for one answer shared by the batch or one per example.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.analysis.inputs import examples, left_pad
from attnlab.analysis.maps import answer_token, continuation_ids, language_model_prompt
from attnlab.errors import UsageError
from attnlab.nn.models import POOLINGS
from attnlab.resources import check_input_tokens
from attnlab.run.loaded import LoadedRun

__all__ = [
    "Measure",
    "Runner",
    "RUNNERS",
    "METRICS",
    "Batch",
    "runner_of",
    "examples_of",
    "batch_of",
    "answer_ids",
    "language_model_measure",
    "user_measure",
]

Measure = Callable[[Tensor], Tensor]
"""The metric of a batch of outputs: (k B, ...) -> (k B,), k copies of the B examples in order."""

METRICS = ("logit_diff", "loss", "logprob")
"""What a language model's patching measures by name (see :mod:`attnlab.analysis.patching`)."""


@dataclass(frozen=True)
class Runner:
    """How a model kind turns a text into ids, and ids into the output that is measured.

    Attributes:
        ids: (loaded, text) -> the token ids the model reads.
        output: (loaded, tokens (B, T), is_token (B, T)) -> (B, ...) what the metric reads: the
            logits (B, T, V), the sentence embedding, the class logits.
        measure: (loaded, clean output, corrupt output) -> the metric and what it is, for people
            (the kinds without named metrics).
        what: the model kind, for messages.
        reads_answer: whether it measures named metrics of ``answer`` and ``wrong`` (a language
            model's next tokens); for the other kinds giving them is an error, not silently ignored.
    """

    ids: Callable[[LoadedRun, str], list[int]]
    output: Callable[[LoadedRun, Tensor, Tensor], Tensor]
    measure: Callable[[LoadedRun, Tensor, Tensor], tuple[Measure, str]] | None
    what: str
    reads_answer: bool = False


def _encoder_ids(loaded: LoadedRun, text: str) -> list[int]:
    ids = loaded.codec.encode(text)
    check_input_tokens(len(ids), context=loaded.model.config.max_len)
    return ids


def _encoder_output(loaded: LoadedRun, tokens: Tensor, is_token: Tensor) -> Tensor:
    hidden = loaded.model(tokens)
    return POOLINGS[loaded.task.pooling](hidden, is_token)  # (B, d_model)


def _classifier_ids(loaded: LoadedRun, text: str) -> list[int]:
    ids = loaded.codec.encode(text) + [loaded.task.eos_id]
    check_input_tokens(len(ids), context=loaded.model.config.max_len)
    return ids


def _tile(values: Tensor, rows: int) -> Tensor:
    """``values`` (B, ...) repeated to ``rows`` = k B rows: k copies of the batch, in order."""
    return values.repeat(rows // len(values), *([1] * (values.dim() - 1)))


def _encoder_measure(loaded: LoadedRun, clean: Tensor, corrupt: Tensor) -> tuple[Measure, str]:
    """The cosine of each example's sentence embedding to its clean one."""
    return lambda out: F.cosine_similarity(out, _tile(clean, len(out)), dim=-1), "cosine to the clean embedding"


def _classifier_measure(loaded: LoadedRun, clean: Tensor, corrupt: Tensor) -> tuple[Measure, str]:
    """Each example's clean class logit minus its largest other class logit."""
    chosen = clean.argmax(-1)  # (B,)

    def margin(out: Tensor) -> Tensor:
        index = _tile(chosen, len(out))[:, None]
        return out.gather(-1, index)[:, 0] - out.scatter(-1, index, float("-inf")).max(-1).values

    return margin, "logit of the clean run's class minus the largest other"


RUNNERS: dict[str, Runner] = {
    "decoder_only": Runner(
        language_model_prompt,
        lambda loaded, tokens, is_token: loaded.model(tokens, is_token=is_token),  # (B, T, V)
        None,
        "language model",
        reads_answer=True,
    ),
    "encoder": Runner(_encoder_ids, _encoder_output, _encoder_measure, "sentence encoder"),
    "encoder_classifier": Runner(
        _classifier_ids, lambda loaded, tokens, is_token: loaded.model(tokens), _classifier_measure, "classifier"
    ),
}
"""Registry: model kind -> :class:`Runner`. An encoder-decoder is not here: its output is a decoded
sequence, whose length the patch itself can change."""


def runner_of(loaded: LoadedRun, flag: str = "RUN") -> Runner:
    kind = loaded.experiment.model_kind
    if kind not in RUNNERS:
        raise UsageError(
            f"{flag}: patching reads one output of a language model, sentence encoder or classifier; "
            f"this run's model is {kind!r} (its output is a decoded sequence)"
        )
    return RUNNERS[kind]


# ---- inputs: texts or ids, one or a batch ---------------------------------------------------------------


def examples_of(loaded: LoadedRun, runner: Runner, given: Any, flag: str) -> list[list[int]]:
    """The examples of ``given`` (:func:`attnlab.analysis.inputs.examples`), a text read as the
    model kind reads it."""
    return examples(loaded, given, flag, encode=runner.ids)


@dataclass(frozen=True)
class Batch:
    """Examples left-padded into one batch: ``tokens`` (B, T) and ``is_token`` (B, T), True at real tokens."""

    tokens: Tensor
    is_token: Tensor

    def tiled(self, rows: int) -> Batch:
        """k = rows / B copies of the batch, in order (example i of copy c at row c B + i)."""
        return Batch(_tile(self.tokens, rows), _tile(self.is_token, rows))


def batch_of(rows: Sequence[list[int]], pad: int, device: torch.device) -> Batch:
    """``rows`` left-padded with ``pad`` (the last position is every example's last token)."""
    return Batch(*left_pad(rows, pad, device))


# ---- a language model's named metrics -------------------------------------------------------------------


def answer_ids(loaded: LoadedRun, metric: str, answer: Any) -> list[int]:
    """The answer's tokens that ``logprob`` reads teacher-forced (none for the other metrics, or
    without an answer: the clean run's top next token then)."""
    if metric != "logprob" or answer is None:
        return []
    if not isinstance(answer, str):
        raise UsageError("--answer: logprob reads one answer text for the whole batch (its tokens are appended)")
    ids = continuation_ids(loaded, answer)
    if not ids:
        raise UsageError(f"--answer: {answer!r} is no token; give the text whose log-probability is measured")
    return ids


def _log_probs(out: Tensor) -> Tensor:
    """log-softmax over the vocabulary in at least float32."""
    return F.log_softmax(out.to(torch.promote_types(out.dtype, torch.float32)), -1)


def _tokens(loaded: LoadedRun, given: Any, flag: str, batch: int, default: Tensor) -> Tensor:
    """(B,) token ids: one for the batch (a text of one token, or an id) or one per example, or ``default``."""
    if given is None:
        return default
    values = given if isinstance(given, (list, tuple)) else [given] * batch
    if len(values) != batch:
        raise UsageError(f"{flag}: {len(values)} tokens for a batch of {batch} examples; give one, or one each")
    return torch.tensor([answer_token(loaded, value, flag) for value in values], device=default.device)


def language_model_measure(
    loaded: LoadedRun, clean: Tensor, corrupt: Tensor, metric: str, answer: Any, wrong: Any, appended: list[int]
) -> tuple[Measure, str]:
    """Each example's answer logit minus its wrong token's at the last position, or the answer's
    log-probability (``appended``: its tokens but the last, teacher-forced after the prompt).

    Args:
        answer, wrong: a text of one token or an id (the same for every example), a list of them
            (one per example), or None: each example's clean (corrupt) run's top next token.

    Shape:
        clean, corrupt: (B, T, V), the logits of the two batches.
    """
    label = lambda i: repr(loaded.codec.tokens([int(i)])[0])  # noqa: E731
    if appended:  # logprob: sum_i log p(a_i | prompt, a_<i), the logits at the last n positions
        n = len(appended)
        index = torch.tensor(appended, device=clean.device)  # (n,)
        shown = " ".join(label(i) for i in appended)

        def logprob(out: Tensor) -> Tensor:
            last = _log_probs(out[:, out.shape[1] - n :])  # (k B, n, V)
            return last.gather(-1, index.expand(out.shape[0], n).unsqueeze(-1)).squeeze(-1).sum(-1)

        return logprob, f"log p({shown}) after the prompt, teacher-forced ({n} tokens)"
    batch = len(clean)
    good = _tokens(loaded, answer, "--answer", batch, clean[:, -1].argmax(-1))
    of = "" if batch == 1 else f" (mean over {batch} examples)"
    shown = label(good[0]) if bool((good == good[0]).all()) else "answer"
    if metric in ("loss", "logprob"):
        return (
            lambda out: _log_probs(out[:, -1]).gather(-1, _tile(good, len(out))[:, None])[:, 0],
            f"log p({shown}) at the last position{of}",
        )
    bad = _tokens(loaded, wrong, "--wrong", batch, corrupt[:, -1].argmax(-1))
    same = (good == bad).nonzero().flatten().tolist()
    if same:
        where = "" if batch == 1 else f" (example {same[0]})"
        raise UsageError(
            f"--answer/--wrong: the clean and the corrupt input both lead to {label(good[same[0]])}{where}; give two "
            "different next tokens (--answer for the clean input's, --wrong for the corrupt one's), or --metric loss"
        )
    wrong_shown = label(bad[0]) if bool((bad == bad[0]).all()) else "wrong"

    def difference(out: Tensor) -> Tensor:
        last = out[:, -1]
        pair = torch.stack([_tile(good, len(out)), _tile(bad, len(out))], -1)  # (k B, 2)
        chosen = last.gather(-1, pair)
        return chosen[:, 0] - chosen[:, 1]

    return difference, f"logit[{shown}] - logit[{wrong_shown}] at the last position{of}"


def user_measure(metric: Callable[[Tensor], Tensor]) -> Measure:
    """A metric given as a function, checked to give one value per example."""

    def measure(out: Tensor) -> Tensor:
        value = metric(out)
        if not isinstance(value, Tensor) or value.shape != (out.shape[0],):
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise UsageError(f"metric: must map the output ({out.shape[0]}, ...) to ({out.shape[0]},); it gave {shape}")
        return value

    return measure
