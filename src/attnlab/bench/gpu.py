"""``gpu``: attnlab on a CUDA GPU against Hugging Face, on Llama-shaped models with random weights.

The models are built from transformers' ``LlamaConfig`` with the shapes of Llama 3.2 1B (and, where
the GPU has 40 GiB or more, Llama 3.1 8B), random weights, saved in bfloat16 as a Hugging Face
folder and opened by each system on the GPU in bfloat16: attnlab natively (``open_model(device=
"cuda")``), transformers' ``AutoModelForCausalLM`` (SDPA) and, where the ``bench-tl`` extra is
installed, TransformerLens' ``TransformerBridge`` over it. On a batch of random ids
(4 x 512) each does, timed in interleaved rounds with the GPU synchronised after each call:

1. ``forward``: the logits, nothing hooked (all three);
2. ``cache all``: one forward with every named site cached (attnlab, ``run_with_cache``;
   transformers' nearest is ``output_hidden_states`` + ``output_attentions``, the eager path);
3. ``importance``: Michel et al.'s I_h, one forward and one backward (attnlab, TransformerLens);
4. ``patch heads``: exact patching of every head's ``z`` on prompts of 32 tokens (attnlab;
   TransformerLens per head, as in ``bench tl``, times every head);
5. ``generate``: greedy decoding of 64 tokens after a 128-token prompt with the KV cache (attnlab,
   transformers).

Each task also reports the GPU's peak allocated memory (``torch.cuda.max_memory_allocated``).
``--quick`` runs the code paths on a tiny model, on the CPU where there is no GPU (no figures).
``benchmarks/gpu.sh`` runs the CUDA tests and then this benchmark, in one command.
"""

from __future__ import annotations

import gc
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from attnlab.analysis.heads import head_importance
from attnlab.analysis.lm_probe import NextTokenProbe
from attnlab.analysis.maps import language_model_prompt
from attnlab.analysis.patching import patch
from attnlab.bench.harness import BenchResult, hf_greedy_generate, interleaved_median_times
from attnlab.bench.tl import _bridge, _prompt_pair, _sliced_patching, _Tl
from attnlab.errors import UsageError
from attnlab.generate.search import DecodeOptions, generate_continuations
from attnlab.nn import trace
from attnlab.pretrained.sources import open_model

__all__ = ["SHAPES", "run_gpu"]


@dataclass(frozen=True)
class Shape:
    """A Llama-shaped model's sizes (transformers' LlamaConfig names)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    min_gpu_gib: float


SHAPES = {
    "llama-1b": Shape(2048, 16, 32, 8, 8192, 128256, True, 0),
    "llama-8b": Shape(4096, 32, 32, 8, 14336, 128256, False, 40),
}
"""Llama 3.2 1B's and Llama 3.1 8B's shapes; each is run where the GPU has ``min_gpu_gib``."""

QUICK = Shape(64, 2, 4, 2, 128, 320, True, 0)
BATCH, TOKENS, PATCH_TOKENS, PROMPT, NEW = 4, 512, 32, 128, 64


def run_gpu(quick: bool = False, repeats: int = 5) -> BenchResult:
    """The measurements of the module docstring."""
    cuda = torch.cuda.is_available()
    if not cuda and not quick:
        raise UsageError("bench gpu: needs a CUDA GPU (none is visible); --quick runs its code paths on the CPU")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    result = BenchResult("gpu")
    result.notes.append(f"device: {torch.cuda.get_device_name(0) if cuda else 'cpu (--quick, no GPU)'}")
    memory = torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else 0.0
    shapes = {"quick": QUICK} if quick else {n: s for n, s in SHAPES.items() if memory >= s.min_gpu_gib}
    for name, shape in shapes.items():
        with tempfile.TemporaryDirectory(prefix="attnlab-bench-gpu-") as tmp:
            _build(shape, Path(tmp), dtype)
            _measure(result, name, Path(tmp), device, dtype, quick, repeats)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return result


def _build(shape: Shape, folder: Path, dtype: torch.dtype) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from attnlab.bench.hf import _save_tokenizer

    config = LlamaConfig(
        **{k: v for k, v in vars(shape).items() if k != "min_gpu_gib"},
        max_position_embeddings=2048,
        rope_theta=500000.0,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(folder)
    _save_tokenizer(folder)
    del model


def _measure(
    result: BenchResult, label: str, folder: Path, device: torch.device, dtype: torch.dtype, quick: bool, repeats: int
) -> None:
    from transformers import AutoModelForCausalLM

    batch, tokens_each, patch_tokens, prompt, new = (
        (2, 16, 6, 8, 4) if quick else (BATCH, TOKENS, PATCH_TOKENS, PROMPT, NEW)
    )
    loaded = open_model(folder, device=device, dtype=dtype)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    model = loaded.model
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, vocab, (batch, tokens_each), generator=generator).to(device)
    start = torch.randint(3, vocab, (1, prompt), generator=generator).to(device)
    clean, corrupt = _prompt_pair(loaded, patch_tokens)

    @torch.inference_mode()
    def forward() -> None:
        model(tokens)

    @torch.inference_mode()
    def hf_forward() -> None:
        hf(tokens, use_cache=False)

    @torch.inference_mode()
    def cache_all() -> None:
        with trace(model, "*"):
            model(tokens)

    @torch.inference_mode()
    def hf_states() -> None:
        hf.set_attn_implementation("eager")  # transformers returns attentions from its eager path only
        try:
            hf(tokens, use_cache=False, output_hidden_states=True, output_attentions=True)
        finally:
            hf.set_attn_implementation("sdpa")

    def importance() -> None:
        head_importance(NextTokenProbe.of_ids(loaded, tokens))

    def patch_heads() -> None:
        patch(loaded, clean, corrupt, metric="loss", sites=("heads",))

    def generate() -> None:
        options = DecodeOptions(max_length=new)
        generate_continuations(model, [start[0].tolist()], eos_id=-1, banned=(), options=options)

    def hf_generate() -> None:
        hf_greedy_generate(hf, start, new, eos_token_id=1, pad_token_id=2)

    groups: dict[str, dict[str, Callable[[], Any]]] = {
        "forward": {"attnlab": forward, "transformers": hf_forward},
        "cache all": {"attnlab": cache_all, "transformers (hidden states + attentions)": hf_states},
        "importance": {"attnlab": importance},
        "patch heads": {"attnlab": patch_heads},
        "generate": {"attnlab": generate, "transformers": hf_generate},
    }
    tl = _bridge(folder, str(device), dtype)  # TransformerLens' bridge, where the bench-tl extra is installed
    if tl is not None:
        layers, heads = model.head_mask_shapes()["self"]
        wrapped = _Tl(tl, layers, heads)
        pair = [torch.tensor([language_model_prompt(loaded, text)], device=device) for text in (clean, corrupt)]
        with torch.inference_mode():
            answer = int(model(pair[0])[0, -1].argmax())
        every = [(layer, head) for layer in range(layers) for head in range(heads)]
        groups["forward"]["TransformerLens bridge"] = lambda: _none(wrapped.model(tokens))
        groups["cache all"]["TransformerLens bridge"] = lambda: _none(wrapped.cache_all(tokens))
        groups["importance"]["TransformerLens bridge"] = lambda: _none(wrapped.importance(tokens))
        groups["patch heads"]["TransformerLens bridge"] = _sliced_patching(wrapped, "tl", *pair, answer, every, {})
    for task, systems in groups.items():
        print(f"bench gpu: {label}: timing {task} ({', '.join(systems)})", file=sys.stderr, flush=True)
        synced = {name: _synchronised(run, device) for name, run in systems.items()}
        times = interleaved_median_times(synced, repeats=repeats)
        if task == "patch heads" and "TransformerLens bridge" in times:  # its per-head median, for every head
            times["TransformerLens bridge"] *= len(every)
        for system, seconds in times.items():
            result.add(f"{system} {label}", f"{task} s", seconds, "s")
            peak = _peak_memory(systems[system], device)
            if peak is not None:
                result.add(f"{system} {label}", f"{task} peak GPU memory", peak / 2**30, "GiB")
        if "transformers" in times:
            result.ratios[f"{label}.{task}.transformers_vs_attnlab_time"] = times["transformers"] / times["attnlab"]
        if "TransformerLens bridge" in times:
            result.ratios[f"{label}.{task}.tl_vs_attnlab_time"] = times["TransformerLens bridge"] / times["attnlab"]
    if tl is None:
        result.notes.append("TransformerLens is not installed (the bench-tl extra): attnlab and transformers only")
    result.notes.append(
        f"{label}: {model.config.layers} layers x {model.config.heads} heads, d_model {model.config.d_model}, "
        f"{str(dtype).removeprefix('torch.')}; batch {batch} x {tokens_each} random ids; patching 1 x {patch_tokens}; "
        f"generation {new} tokens after {prompt}"
    )


def _none(value: Any) -> None:
    return None  # not what the system returned: an int would count units of work (interleaved_median_times)


def _synchronised(run: Callable[[], Any], device: torch.device) -> Callable[[], Any]:
    """``run`` followed by a wait for the GPU; what it returns (a count of units of work) kept."""

    def timed() -> Any:
        done = run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return done

    return timed


def _peak_memory(run: Callable[[], Any], device: torch.device) -> int | None:
    """The GPU's peak allocated bytes during one more call of ``run`` (None on the CPU)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)
