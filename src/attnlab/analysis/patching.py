"""Activation patching: how much of a clean-vs-corrupt difference one site restores.

Run a model on a clean input and on a corrupt one of the same length; then run the corrupt input
again with one site's value taken from the clean run (:func:`attnlab.nn.hooks.trace`). With m the
measured output (higher = more like the clean run), a patch restores

    r = (m_patched - m_corrupt) / (m_clean - m_corrupt)

of the difference: 1 when the site carries all of it, 0 when none (Vig et al. 2020; Meng et al.
2022, "causal tracing"; Wang et al. 2023). The sites patched are every head's output ``z`` (all
positions; one forward pass per layer with the corrupt input repeated once per head, example i
patching head i) and the residual stream, position by position (``resid_pre`` of every layer and
the last layer's ``resid_post``; one forward pass per layer with the corrupt input repeated once
per position).

What is measured, by the run's model kind (:data:`RUNNERS`):

* a language model: the logit difference at the last position between the ``answer`` token and the
  ``wrong`` one (by default the clean and the corrupt run's top next tokens), or with
  ``metric="loss"`` the answer's log-probability there (minus its next-token loss);
* a sentence encoder: the cosine of the sentence embedding (the task's pooling) to the clean one;
* a classifier: the logit of the clean run's class minus the largest other class logit.

:func:`head_means` gives each head's mean output over a text file, for mean ablation
(``attnlab heads ablate --mean-over FILE``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.analysis.maps import language_model_prompt  # the prompt `attnlab attention` reads
from attnlab.devices import model_device
from attnlab.errors import UsageError
from attnlab.nn.hooks import trace
from attnlab.nn.models import POOLINGS
from attnlab.resources import check_input_text, check_input_tokens
from attnlab.run.loaded import LoadedRun
from attnlab.tasks.text import read_lines

__all__ = ["HeadPatch", "ResidualPatch", "PatchResult", "patch", "head_means", "METRICS", "RUNNERS"]

METRICS = ("logit_diff", "loss")
"""What a language model's patching measures at the last position (see the module docstring)."""


@dataclass(frozen=True)
class HeadPatch:
    kind: str
    layer: int
    head: int
    restored: float
    metric: float


@dataclass(frozen=True)
class ResidualPatch:
    layer: int
    site: str
    position: int
    token: str
    restored: float
    metric: float


@dataclass(frozen=True)
class PatchResult:
    """Both runs' metric, what was measured, and every patch's restored fraction.

    Attributes:
        measure: what the metric is, for people (``logit[" Paris"] - logit[" Rome"] at the last
            position``, ``cosine to the clean embedding``, ...).
        clean_tokens, corrupt_tokens: the two inputs' token labels.
        heads, residual: one row per patch.
    """

    measure: str
    metric_clean: float
    metric_corrupt: float
    clean_tokens: list[str]
    corrupt_tokens: list[str]
    heads: list[HeadPatch]
    residual: list[ResidualPatch]


# ---- how each model kind reads one text, and what is measured -----------------------------------


Measure = Callable[[Tensor], Tensor]
"""The metric of a batch of outputs: (B, ...) -> (B,), higher = more like the clean run."""


@dataclass(frozen=True)
class Runner:
    """How a model kind turns a text into ids, and ids into the output that is measured.

    Attributes:
        ids: (loaded, text) -> the token ids the model reads.
        output: (loaded, tokens (B, T)) -> (B, ...) what the metric reads: the last position's
            logits, the sentence embedding, the class logits.
        measure: (loaded, clean output, corrupt output, metric, answer, wrong) -> the metric and
            what it is, for people.
        what: the model kind, for messages.
        reads_answer: whether ``measure`` reads ``answer`` and ``wrong`` (a language model's next
            tokens); for the other kinds giving them is an error, not silently ignored.
    """

    ids: Callable[[LoadedRun, str], list[int]]
    output: Callable[[LoadedRun, Tensor], Tensor]
    measure: Callable[..., tuple[Measure, str]]
    what: str
    reads_answer: bool = False


def _lm_ids(loaded: LoadedRun, text: str) -> list[int]:
    return language_model_prompt(loaded, text)


def _lm_output(loaded: LoadedRun, tokens: Tensor) -> Tensor:
    return loaded.model(tokens, is_token=torch.ones_like(tokens, dtype=torch.bool))[:, -1]  # (B, V)


def _encoder_ids(loaded: LoadedRun, text: str) -> list[int]:
    ids = loaded.codec.encode(text)
    check_input_tokens(len(ids), context=loaded.model.config.max_len)
    return ids


def _encoder_output(loaded: LoadedRun, tokens: Tensor) -> Tensor:
    hidden = loaded.model(tokens)
    return POOLINGS[loaded.task.pooling](hidden, torch.ones_like(tokens, dtype=torch.bool))  # (B, d_model)


def _classifier_ids(loaded: LoadedRun, text: str) -> list[int]:
    ids = loaded.codec.encode(text) + [loaded.task.eos_id]
    check_input_tokens(len(ids), context=loaded.model.config.max_len)
    return ids


def _classifier_output(loaded: LoadedRun, tokens: Tensor) -> Tensor:
    return loaded.model(tokens)  # (B, C)


def _one_token(loaded: LoadedRun, text: str, flag: str) -> int:
    ids = loaded.codec.encode(text)
    if len(ids) != 1:
        shown = " ".join(repr(t) for t in loaded.codec.tokens(ids))
        raise UsageError(f"{flag}: {text!r} is {len(ids)} tokens ({shown}); give text that is one token")
    return ids[0]


def _lm_measure(
    loaded: LoadedRun, clean: Tensor, corrupt: Tensor, metric: str, answer: str | None, wrong: str | None
) -> tuple[Measure, str]:
    """The answer's logit minus the wrong token's at the last position, or the answer's log-probability."""
    label = lambda i: repr(loaded.codec.tokens([i])[0])  # noqa: E731
    good = _one_token(loaded, answer, "--answer") if answer is not None else int(clean[0].argmax())
    if metric == "loss":
        return lambda out: F.log_softmax(out.float(), -1)[:, good], f"log p({label(good)}) at the last position"
    bad = _one_token(loaded, wrong, "--wrong") if wrong is not None else int(corrupt[0].argmax())
    if bad == good:
        raise UsageError(
            f"--answer/--wrong: the clean and the corrupt input both lead to {label(good)}; give two different "
            "next tokens (--answer for the clean input's, --wrong for the corrupt one's), or --metric loss"
        )
    return lambda out: out[:, good] - out[:, bad], f"logit[{label(good)}] - logit[{label(bad)}] at the last position"


def _encoder_measure(loaded: LoadedRun, clean: Tensor, corrupt: Tensor, *_: object) -> tuple[Measure, str]:
    """The cosine of the sentence embedding to the clean one."""
    reference = clean[0]
    return lambda out: F.cosine_similarity(out, reference.expand_as(out), dim=-1), "cosine to the clean embedding"


def _classifier_measure(loaded: LoadedRun, clean: Tensor, corrupt: Tensor, *_: object) -> tuple[Measure, str]:
    """The clean run's class logit minus the largest other class logit."""
    chosen = int(clean[0].argmax())

    def margin(out: Tensor) -> Tensor:
        others = out.clone()
        others[:, chosen] = float("-inf")
        return out[:, chosen] - others.max(-1).values

    return margin, f"logit of class {chosen} (the clean run's) minus the largest other"


RUNNERS: dict[str, Runner] = {
    "decoder_only": Runner(_lm_ids, _lm_output, _lm_measure, "language model", reads_answer=True),
    "encoder": Runner(_encoder_ids, _encoder_output, _encoder_measure, "sentence encoder"),
    "encoder_classifier": Runner(_classifier_ids, _classifier_output, _classifier_measure, "classifier"),
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


# ---- what is measured ----------------------------------------------------------------------------


# ---- patching ------------------------------------------------------------------------------------


def patch(
    loaded: LoadedRun,
    clean_text: str,
    corrupt_text: str,
    *,
    metric: str = "logit_diff",
    answer: str | None = None,
    wrong: str | None = None,
    heads: bool = True,
    residual: bool = True,
    progress: Callable[[], None] | None = None,
) -> PatchResult:
    """Patch every head's output and the residual stream at every layer and position from the clean
    run into the corrupt one (see the module docstring).

    Raises:
        UsageError: an encoder-decoder run, inputs of different token counts (both tokenizations
            shown), an unknown metric, an answer that is not one token, the same answer and wrong
            token, an answer or wrong token for a model that is not a language model (it measures
            no next token), or inputs the model measures alike (nothing to restore).
    """
    if metric not in METRICS:
        raise UsageError(f"--metric: unknown {metric!r}; allowed: {', '.join(METRICS)}")
    runner = runner_of(loaded)
    given = [flag for flag, value in (("--answer", answer), ("--wrong", wrong)) if value is not None]
    if given and not runner.reads_answer:
        raise UsageError(
            f"{given[0]}: only for a language model (the next token it measures); this run is a {runner.what}, "
            "which patching measures without one; leave it out"
        )
    check_input_text(clean_text, what="--clean")
    check_input_text(corrupt_text, what="--corrupt")
    clean_ids, corrupt_ids = runner.ids(loaded, clean_text), runner.ids(loaded, corrupt_text)
    clean_tokens, corrupt_tokens = loaded.codec.tokens(clean_ids), loaded.codec.tokens(corrupt_ids)
    if len(clean_ids) != len(corrupt_ids):
        raise UsageError(
            f"--clean and --corrupt must have the same number of tokens: clean has {len(clean_ids)} "
            f"({' | '.join(clean_tokens)}), corrupt has {len(corrupt_ids)} ({' | '.join(corrupt_tokens)})"
        )
    model = loaded.model.eval()
    device = model_device(model)
    clean, corrupt = (torch.tensor([ids], device=device) for ids in (clean_ids, corrupt_ids))
    stack, layers = _stack_of(model)
    head_sites = [f"{stack}.{layer}.attn.z" for layer in range(layers)]
    residual_sites = [f"{stack}.{layer}.resid_pre" for layer in range(layers)] + [f"{stack}.{layers - 1}.resid_post"]
    tick = progress or (lambda: None)
    with torch.no_grad():
        with trace(model, cache=head_sites + residual_sites) as seen:
            clean_out = runner.output(loaded, clean)
        corrupt_out = runner.output(loaded, corrupt)
        measure, measured = runner.measure(loaded, clean_out, corrupt_out, metric, answer, wrong)
        m_clean, m_corrupt = float(measure(clean_out)[0]), float(measure(corrupt_out)[0])
        if abs(m_clean - m_corrupt) <= 1e-6 * max(1.0, abs(m_clean)):
            raise UsageError(
                f"--clean/--corrupt: the model measures both alike ({measured}: {m_clean:.6g} and "
                f"{m_corrupt:.6g}); there is no difference for a patch to restore"
            )

        def restored(out: Tensor) -> list[tuple[float, float]]:
            values = measure(out).double().tolist()
            return [((v - m_corrupt) / (m_clean - m_corrupt), v) for v in values]

        head_rows: list[HeadPatch] = []
        for layer, site in enumerate(head_sites if heads else []):
            count = seen.cache[site].shape[1]
            with trace(model) as t:
                for h in range(count):  # example h gets head h's clean output
                    t.replace(site, seen.cache[site], examples=[h], heads=[h])
                out = runner.output(loaded, corrupt.expand(count, -1))
            kind = seen.sites[site].kind
            head_rows += [HeadPatch(kind, layer, h, r, m) for h, (r, m) in enumerate(restored(out))]
            tick()
        residual_rows: list[ResidualPatch] = []
        positions = clean.shape[1]
        for site in residual_sites if residual else []:
            with trace(model) as t:
                for p in range(positions):  # example p gets position p's clean residual
                    t.replace(site, seen.cache[site], examples=[p], positions=[p])
                out = runner.output(loaded, corrupt.expand(positions, -1))
            _, layer, point = site.split(".")
            residual_rows += [
                ResidualPatch(int(layer), point, p, corrupt_tokens[p], r, m) for p, (r, m) in enumerate(restored(out))
            ]
            tick()
    return PatchResult(measured, m_clean, m_corrupt, clean_tokens, corrupt_tokens, head_rows, residual_rows)


def _stack_of(model) -> tuple[str, int]:  # noqa: ANN001
    """The one stack of a model patching supports, and its number of layers."""
    stack, (stack_module, _) = next(iter(model.site_stacks().items()))
    return stack, len(stack_module.layers)


def patch_steps(loaded: LoadedRun, *, heads: bool = True, residual: bool = True) -> int:
    """How many forward passes :func:`patch` makes after the two plain runs (for a progress bar)."""
    _, layers = _stack_of(loaded.model)
    return layers * heads + (layers + 1) * residual


# ---- mean ablation -------------------------------------------------------------------------------


def head_means(loaded: LoadedRun, texts_file: str | Path) -> dict[str, Tensor]:
    """Each head's mean output over the texts of a file: z site name -> (H, d_v).

    Every text (one per non-empty line) is read alone, as patching reads one, so there is no
    padding; the mean is over every position of every text.

    Raises:
        UsageError: a run patching does not support; DataError: an empty or unreadable file.
    """
    runner = runner_of(loaded)
    texts = [line for line in read_lines(Path(texts_file)).items if line.strip()]
    if not texts:
        raise UsageError(f"--mean-over: {texts_file} holds no text")
    model = loaded.model.eval()
    device = model_device(model)
    pattern = f"{_stack_of(model)[0]}.*.attn.z"
    sums: dict[str, Tensor] = {}
    positions = 0
    with torch.no_grad():
        for text in texts:
            tokens = torch.tensor([runner.ids(loaded, text)], device=device)
            with trace(model, cache=pattern) as seen:
                runner.output(loaded, tokens)
            for name, z in seen.cache.items():  # (1, H, T, d_v)
                sums[name] = sums.get(name, 0) + z[0].double().sum(1)  # (H, d_v)
            positions += tokens.shape[1]
    return {name: (total / positions).to(torch.float32) for name, total in sums.items()}
