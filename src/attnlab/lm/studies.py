"""The analyses of a loaded model, as its methods: each on texts or token ids, one or a batch,
giving tensors back (with tables and pictures made from them), with a progress bar on stderr
where the work takes more than a moment (``progress=False`` turns it off).

=====================  ===============================================  ==================================
method                 what it computes                                 the command that calls it
=====================  ===============================================  ==================================
``patch``              restored fraction of each head / position        ``attnlab patch``
``attribute``          each head's and layer's direct logit effect,     ``attnlab attribute``
                       and the logit lens
``detect``             every head's previous-token, duplicate,          ``attnlab heads detect``
                       induction, sink and positional scores
``ablate``             the metric with each head off, and with all      ``attnlab heads ablate``
                       heads of its layer but it
``importance``         Michel et al.'s I_h = E_x |dL/dxi_h|             ``attnlab heads importance``
``run_with_cache``     logits and a cache with TransformerLens' helpers
``test_prompt``        an answer's rank and probability at each token
``show_patterns``      a layer's heads inline in a notebook             ``attnlab view``
=====================  ===============================================  ==================================

Every result's tensors index heads as :meth:`attnlab.LanguageModel.head_mask` does:
``[layer, head]``, for each attention kind of the model.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

from torch import Tensor
from tqdm.auto import tqdm

from attnlab.analysis.cache import ActivationCache, run_with_cache
from attnlab.analysis.detectors import Detection, detect_heads
from attnlab.analysis.head_scores import HeadScores
from attnlab.analysis.heads import Ablation, TaskProbe, ablate, head_importance, scoring_pairs
from attnlab.analysis.inputs import takes_is_token
from attnlab.analysis.lm_probe import NextTokenProbe
from attnlab.analysis.logit_attribution import Attribution, Attributions, direct_logit_attribution, logit_lens
from attnlab.analysis.patching import PatchResult, patch
from attnlab.analysis.prompt_test import PromptTest, test_prompt
from attnlab.errors import UsageError
from attnlab.run.loaded import LoadedRun
from attnlab.viewer.notebook import AttentionHTML, show, show_patterns

__all__ = ["Studies"]


def _bar(description: str, enabled: bool) -> tuple[Callable[..., None], Callable[[], None]]:
    """(tick, close): a tqdm bar on stderr, made at the first tick (``tick(total)`` sets its
    length), or nothing when not ``enabled``."""
    held: list[Any] = []

    def tick(total: int | None = None) -> None:
        if not enabled:
            return
        if not held:
            held.append(tqdm(total=total, desc=description, unit="pass", leave=False))
        held[0].update(1)

    def close() -> None:
        if held:
            held[0].close()

    return tick, close


class Studies:
    """The analyses of :class:`attnlab.LanguageModel` (a mixin: ``self.loaded`` is the model)."""

    loaded: LoadedRun

    # ---- patching ----------------------------------------------------------------------------------

    def patch(
        self,
        clean: Any,
        corrupt: Any,
        *,
        answer: Any = None,
        wrong: Any = None,
        metric: str | Callable[[Tensor], Tensor] = "logit_diff",
        sites: str | Sequence[str] = "heads",
        positions: str | None = None,
        method: str = "exact",
        verify_top: int = 10,
        batch_size: int = 64,
        progress: bool = True,
    ) -> PatchResult:
        """Activation patching: the share of the clean-versus-corrupt difference each unit restores
        when patched from the clean run into the corrupt one (:mod:`attnlab.analysis.patching`).

        Args:
            clean, corrupt: a text, ids, or a batch (texts, id lists, a (B, T) tensor): example i
                of each of as many tokens; the metric is the mean over the batch.
            answer, wrong: the next tokens of ``logit_diff`` (texts of one token or ids; one for
                the batch or a list, one each); default each run's top next token.
            metric: ``logit_diff``, ``loss``, ``logprob``, or a function of the logits to (B,).
            sites: ``heads`` (every layer's ``attn.z``, head by head), ``residual``, site names
                or globs (``*.ffn.out``): one tensor each.
            positions: ``each`` patches every position apart (a positions axis); default all
                positions for sites with heads.
            method: ``exact`` (a forward pass per unit) or ``attribution`` (one backward pass).

        Returns:
            A :class:`~attnlab.analysis.patching.PatchResult`: ``result["heads"]`` is the
            (layers, heads) restored fraction; ``.dims("heads")`` names the axes; ``.to_csv``,
            ``.to_frame``, and the rows in ``.groups``.
        """
        tick, close = _bar("patch", progress)
        try:
            return patch(
                self.loaded,
                clean,
                corrupt,
                metric=metric,
                answer=answer,
                wrong=wrong,
                sites=[sites] if isinstance(sites, str) else list(sites),
                positions=positions,
                method=method,
                verify_top=verify_top,
                batch_size=batch_size,
                progress=tick,
            )
        finally:
            close()

    # ---- direct logit attribution and the logit lens ---------------------------------------------

    def attribute(self, text: Any, answer: Any, wrong: Any = None, *, top_k: int = 5) -> Attribution | Attributions:
        """Direct logit attribution at the last position, the final norm's scale frozen
        (:mod:`attnlab.analysis.logit_attribution`), and the logit lens on the same prompt.

        Args:
            text: a prompt (a text or its ids), or a batch (a list of them, a (B, T) tensor).
            answer, wrong: a text of one token or an id; for a batch one for all or a list.
            top_k: tokens each row of the logit lens lists.

        Returns:
            For one prompt an :class:`~attnlab.analysis.logit_attribution.Attribution`:
            ``.head_effects`` (layers, heads), ``.layer_effects`` (layers, 2: attention, FFN),
            ``.terms`` summing to ``.total``, ``.lens`` the logit lens. For a batch an
            :class:`~attnlab.analysis.logit_attribution.Attributions` of them, its tensors with
            a batch axis first.
        """
        prompts = _prompts(text)
        if prompts is None:
            found = direct_logit_attribution(self.loaded, text, answer, wrong)
            return replace(found, lens=logit_lens(self.loaded, text, answer=answer, top_k=top_k))
        answers, wrongs = _each(answer, len(prompts), "answer"), _each(wrong, len(prompts), "wrong")
        return Attributions(
            [
                replace(
                    direct_logit_attribution(self.loaded, one, good, bad),
                    lens=logit_lens(self.loaded, one, answer=good, top_k=top_k),
                )
                for one, good, bad in zip(prompts, answers, wrongs, strict=True)
            ]
        )

    # ---- head analyses ------------------------------------------------------------------------------

    def detect(
        self,
        texts: str | os.PathLike[str] | None = None,
        *,
        length: int | None = None,
        batch_size: int = 8,
        seed: int = 0,
        progress: bool = True,
    ) -> Detection:
        """Every head's score for previous-token, duplicate-token, induction, sink (``bos``) and
        positional attention (:mod:`attnlab.analysis.detectors`), on repeated random tokens (and
        on a text file's texts for the patterns that need no repeats).

        Returns:
            A :class:`~attnlab.analysis.detectors.Detection`: ``.scores("induction")`` is a
            :class:`~attnlab.analysis.head_scores.HeadScores` ((layers, heads) per kind),
            ``.top("induction")`` the best heads.
        """
        return detect_heads(self.loaded, texts=texts, length=length, batch=batch_size, seed=seed, progress=progress)

    def ablate(
        self,
        texts: Any,
        *,
        max_texts: int | None = None,
        batch_size: int = 16,
        progress: bool = True,
    ) -> Ablation:
        """Michel et al. §3's two experiments on the next-token loss of ``texts``: each head
        masked alone, and all heads of a layer but one.

        Args:
            texts: a file (one text per line), a list of texts, or ids ((B, T) tensor).

        Returns:
            An :class:`~attnlab.analysis.heads.Ablation`: ``.deltas()`` the perplexity change of
            each head alone as :class:`~attnlab.analysis.head_scores.HeadScores`, and the rows.
        """
        probe = self._probe(texts, max_texts=max_texts, batch_size=batch_size)
        count = 2 * sum(layers * heads for layers, heads in self.loaded.model.head_mask_shapes().values())
        bar = tqdm(total=count, desc="ablate", unit="mask", leave=False, disable=not progress)
        try:
            return ablate(probe, progress=lambda: bar.update(1))
        finally:
            bar.close()

    @takes_is_token
    def importance(
        self,
        texts: Any,
        is_token: Tensor | None = None,
        *,
        max_texts: int | None = None,
        batch_size: int = 16,
        progress: bool = True,
    ) -> HeadScores:
        """Michel et al.'s I_h = E_x |dL(x)/dxi_h| for every head, one forward and backward pass
        per batch (L the next-token loss; ``attnlab heads importance``).

        Args:
            texts: a file (one text per line), a list of texts, or ids: a (B, T) tensor (with
                ``is_token``, True at real tokens) or a list of id lists. A pretrained
                encoder-decoder takes a file of ``source<TAB>target`` lines (the target's loss).
            max_texts: score only the first this many texts of a file or list.

        Returns:
            :class:`~attnlab.analysis.head_scores.HeadScores`: ``.tensor`` (layers, heads), one
            per kind for an encoder-decoder; ``.top(5)`` the most important heads.
        """
        if self.loaded.experiment.model_config_class.reads_source_and_target:
            if not isinstance(texts, (str, os.PathLike)):
                raise UsageError("texts: an encoder-decoder scores a file of source<TAB>target lines")
            probe: Any = TaskProbe(scoring_pairs(self.loaded, texts), "valid", batch_size=batch_size)
        else:
            probe = self._probe(texts, is_token, max_texts=max_texts, batch_size=batch_size)
        batches = sum(1 for _ in probe.batches())
        bar = tqdm(total=batches, desc="importance", unit="batch", leave=False, disable=not progress)
        try:
            scores = head_importance(probe, progress=lambda: bar.update(1))
        finally:
            bar.close()
        return HeadScores("importance", {kind: value.double().cpu() for kind, value in scores.items()})

    # ---- the cache, a prompt's answer, and the notebook views ------------------------------------------

    @takes_is_token
    def run_with_cache(
        self, inputs: Any, is_token: Tensor | None = None, *, names: str | Sequence[str] | None = None
    ) -> tuple[Tensor, ActivationCache]:
        """Run once and cache every site (or ``names`` and what the helpers read): (logits,
        :class:`~attnlab.analysis.cache.ActivationCache`), with TransformerLens' helpers
        ``accumulated_resid``, ``decompose_resid``, ``stack_head_results``, ``apply_final_norm``
        and ``logit_attrs``, whose parts sum to the logits exactly (:mod:`attnlab.analysis.cache`).

        Args:
            inputs: a text, texts (left-padded), ids, id lists, or a (B, T) tensor of ids.
            is_token: (B, T) True at real tokens, with ids as a tensor.
        """
        return run_with_cache(self.loaded, inputs, is_token, names)

    def test_prompt(
        self,
        prompt: str,
        answer: str | Sequence[int],
        *,
        top_k: int = 10,
        prepend_space: bool = True,
        show: bool = True,
    ) -> PromptTest:
        """Print, at each token of ``answer`` after ``prompt``, its rank (0: the top), logit and
        probability and the ``top_k`` most likely tokens (TransformerLens' ``test_prompt``);
        returns the same as a :class:`~attnlab.analysis.prompt_test.PromptTest`."""
        return test_prompt(self.loaded, prompt, answer, top_k=top_k, prepend_space=prepend_space, print_details=show)

    def show_patterns(
        self, text: str, layer: int | None = None, *, heads: Iterable[int] | None = None
    ) -> AttentionHTML:
        """A layer's heads on ``text``, inline in a notebook (Jupyter, JupyterLab, VS Code): point
        at a token to colour the tokens by its attention; one button per head (default: the last
        layer, every head). Self-contained HTML, no server (:func:`attnlab.viewer.notebook.show_patterns`)."""
        return show_patterns(self.loaded, text, layer, heads=heads)

    def show(self, text: str, *, view: str = "model", **options: Any) -> AttentionHTML:
        """The viewer's views inline: ``model`` (every layer x head as a grid of thumbnails, click
        to enlarge), ``layer``, ``head``, ``patterns`` (:func:`attnlab.viewer.notebook.show`)."""
        return show(self.loaded, text, view=view, **options)

    def _probe(
        self, texts: Any, is_token: Tensor | None = None, *, max_texts: int | None, batch_size: int
    ) -> NextTokenProbe:
        """The next-token probe of a file, a list of texts, or ids."""
        if isinstance(texts, Tensor) or (isinstance(texts, list) and texts and not isinstance(texts[0], str)):
            ids: Any = texts
            if not isinstance(ids, Tensor):
                ids, is_token = self._batch(ids, None)  # type: ignore[attr-defined]
            if max_texts is not None:
                ids = ids[:max_texts]
                is_token = None if is_token is None else is_token[:max_texts]
            return NextTokenProbe.of_ids(self.loaded, ids, is_token)
        if is_token is not None:
            raise UsageError("is_token: only with ids (texts are padded and masked here)")
        return NextTokenProbe(self.loaded, texts, batch_size=batch_size, max_texts=max_texts)


def _prompts(text: Any) -> list[Any] | None:
    """The prompts of a batch (a list of texts or of id lists, a (B, T) tensor), or None for one prompt."""
    if isinstance(text, Tensor):
        return None if text.dim() == 1 else list(text.tolist())
    if isinstance(text, (list, tuple)) and text and not all(isinstance(i, int) for i in text):
        return list(text)
    return None


def _each(value: Any, count: int, name: str) -> list[Any]:
    """One value per prompt: a list of ``count``, or the value repeated."""
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise UsageError(f"{name}: {len(value)} values for a batch of {count} prompts; give one, or one each")
        return list(value)
    return [value] * count
