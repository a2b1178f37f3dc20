"""``test_prompt``: how a language model ranks an expected answer after a prompt, token by token
(TransformerLens' ``utils.test_prompt``, whose printout this follows).

The prompt is read as the model reads it (``task.encode``: a BOS first where the model wants one),
the answer as a continuation (the tokenizer without the BOS, a space put before it by default), and
the model runs once on prompt + answer. At the position before each answer token a_i its logits
l give

    rank(a_i) = #{v : l_v > l_{a_i}}   (0: the most likely token),   p(a_i) = softmax(l)_{a_i},

and the ``top_k`` tokens with their logits and probabilities (after any soft cap, as the model
outputs them). The run's held heads are off, as in every analysis.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from attnlab.analysis.cache import language_model
from attnlab.analysis.inputs import check_token_ids, model_inputs
from attnlab.analysis.maps import continuation_ids
from attnlab.errors import UsageError
from attnlab.nn import masking_heads

__all__ = ["Candidate", "AnswerToken", "PromptTest", "test_prompt"]


@dataclass(frozen=True)
class Candidate:
    """One token of a top-k list."""

    token: str
    id: int
    logit: float
    probability: float


@dataclass(frozen=True)
class AnswerToken:
    """How the model scores one answer token at the position before it.

    Attributes:
        position: the position whose logits predict it (in the prompt + answer ids).
        token, id: the answer token.
        rank: how many tokens have a larger logit (0: it is the most likely).
        logit, probability: its logit and softmax probability there.
        top: the top-k tokens there, most likely first.
    """

    position: int
    token: str
    id: int
    rank: int
    logit: float
    probability: float
    top: list[Candidate]


@dataclass(frozen=True)
class PromptTest:
    """What :func:`test_prompt` found; ``str()`` is its printout.

    Attributes:
        prompt_tokens, answer_tokens: the tokens as the model read them.
        answers: one per answer token.
    """

    prompt_tokens: list[str]
    answer_tokens: list[str]
    answers: list[AnswerToken]

    @property
    def ranks(self) -> list[tuple[str, int]]:
        """(token, rank) of each answer token."""
        return [(answer.token, answer.rank) for answer in self.answers]

    def __str__(self) -> str:
        lines = [f"Tokenized prompt: {self.prompt_tokens}", f"Tokenized answer: {self.answer_tokens}"]
        for answer in self.answers:
            lines.append("Performance on answer token:")
            lines.append(f"Rank: {answer.rank:<8} {_scored(answer.logit, answer.probability, answer.token)}")
            for index, candidate in enumerate(answer.top):
                lines.append(f"Top {index}th token. {_scored(candidate.logit, candidate.probability, candidate.token)}")
        lines.append(f"Ranks of the answer tokens: {self.ranks}")
        return "\n".join(lines)


def _scored(logit: float, probability: float, token: str) -> str:
    return f"Logit: {logit:5.2f} Prob: {probability:6.2%} Token: |{token}|"


@torch.no_grad()
def test_prompt(
    source: Any,
    prompt: str,
    answer: str | Sequence[int],
    top_k: int = 10,
    prepend_space: bool = True,
    print_details: bool = True,
) -> PromptTest:
    """Run ``prompt`` + ``answer`` and report, at each answer token, its rank, logit and probability
    and the ``top_k`` tokens (module docstring); print it unless ``print_details`` is False.

    Args:
        source: a :class:`~attnlab.run.loaded.LoadedRun`, or what ``attnlab.load`` returns.
        prompt: the text before the answer.
        answer: the expected continuation (one token or several), or its ids (a token that is no
            text alone, such as one byte of a character).
        top_k: tokens listed per answer token (1..vocabulary).
        prepend_space: put a space before an answer that does not start with one (TransformerLens'
            ``prepend_space_to_answer``).
        print_details: print the report.

    Returns:
        The :class:`PromptTest`.

    Raises:
        UsageError: a model that is not a decoder-only language model, an empty prompt or answer,
            answer ids outside the vocabulary, a ``top_k`` outside 1..vocabulary, more tokens than
            the context (naming the argument).
    """
    loaded = language_model(source)
    model, codec = loaded.model, loaded.codec
    if isinstance(answer, str):
        if prepend_space and answer and not answer.startswith(" "):
            answer = " " + answer
        answer_ids = continuation_ids(loaded, answer) if answer else []
    else:
        answer_ids = [int(i) for i in answer]
        check_token_ids(torch.tensor(answer_ids, dtype=torch.long), model.config.vocab_size, "answer")
    if not answer_ids:
        raise UsageError(f"answer: {answer!r} is no tokens; give the expected continuation")
    prompt_ids = list(loaded.task.encode(prompt))
    if not prompt_ids:
        raise UsageError("prompt: no tokens; give the text before the answer")
    vocabulary = model.config.vocab_size
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= vocabulary:
        raise UsageError(f"top_k: {top_k!r} is out of range; give 1..{vocabulary}")
    tokens, is_token = model_inputs(loaded, [prompt_ids + answer_ids])
    with masking_heads(model.eval(), loaded.held_mask()):
        logits = model(tokens, is_token=is_token)[0]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # half precision read in float32
    answers = []
    for offset, token in enumerate(answer_ids):
        position = len(prompt_ids) - 1 + offset
        row = logits[position]
        probabilities = torch.softmax(row, -1)
        values, indices = probabilities.topk(top_k)
        top = [
            Candidate(label, int(i), float(row[i]), float(p))
            for label, i, p in zip(codec.tokens(indices.tolist()), indices, values)
        ]
        rank = int((row > row[token]).sum())
        label = codec.tokens([token])[0]
        answers.append(AnswerToken(position, label, token, rank, float(row[token]), float(probabilities[token]), top))
    result = PromptTest(codec.tokens(prompt_ids), codec.tokens(answer_ids), answers)
    if print_details:
        print(result)
    return result


test_prompt.__test__ = False  # type: ignore[attr-defined]  # not a pytest test, whatever imports it
