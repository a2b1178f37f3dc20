"""``decode``: greedy decoding of 128 new tokens at batch 1 and batch 32.

Systems: attnlab with its KV cache (one new token per step; the encoder output projected once per
source), attnlab without it (the whole prefix re-run every step), and Hugging Face ``generate`` on
the same-sized BART. End-of-sequence is never allowed to win, so every system makes exactly the
same number of steps.
"""

from __future__ import annotations

import torch

from attnlab.bench.harness import BenchResult, hf_greedy_generate, interleaved_median_times
from attnlab.bench.models import FULL, QUICK, attnlab_model, hf_available, hf_bart, random_batch
from attnlab.generate.search import EncoderDecoderStepper, greedy_search
from attnlab.kernels.linear import packed_weights

__all__ = ["run_decode"]

BOS, EOS = 1, 2


def run_decode(quick: bool = False, repeats: int = 5) -> BenchResult:
    sizes = QUICK if quick else FULL
    new_tokens = 16 if quick else 128
    result = BenchResult("decode")
    torch.manual_seed(0)
    model = attnlab_model(sizes).eval()
    bart = hf_bart(sizes).eval() if hf_available() else None
    for batch_size in (1, sizes.batch):
        src = random_batch(sizes).src[:batch_size]

        def attnlab_decode(use_cache: bool):  # noqa: ANN202
            @torch.no_grad()
            @packed_weights()  # as decode() runs it: the encoder's pass inside the region too
            def go() -> None:
                stepper = EncoderDecoderStepper(model, src, use_cache=use_cache)
                greedy_search(
                    stepper, torch.full((batch_size, 1), BOS), eos_id=EOS, banned=(0, BOS, EOS), max_length=new_tokens
                )

            return go

        systems = {"attnlab cached": attnlab_decode(True), "attnlab uncached": attnlab_decode(False)}
        if bart is not None:

            def hf_generate() -> None:
                hf_greedy_generate(bart, src, new_tokens, decoder_start_token_id=BOS, eos_token_id=EOS, pad_token_id=0)

            systems["hf generate"] = hf_generate
        metric = f"tokens_per_s_batch{batch_size}"
        for label, seconds in interleaved_median_times(systems, repeats=repeats).items():
            result.add(label, metric, batch_size * new_tokens / seconds, "tokens/s")
        result.ratios[f"cache_vs_nocache_batch{batch_size}"] = result.value("attnlab cached", metric) / result.value(
            "attnlab uncached", metric
        )
        result.targets[f"cache_vs_nocache_batch{batch_size}"] = (">=", 4.0)
        if bart is not None:
            result.ratios[f"cached_vs_hf_batch{batch_size}"] = result.value("attnlab cached", metric) / result.value(
                "hf generate", metric
            )
            result.targets[f"cached_vs_hf_batch{batch_size}"] = (">=", 1.5)
    if bart is None:
        result.notes.append("transformers is not installed (pip install 'attnlab[bench]'): Hugging Face skipped")
    result.notes.append(f"{new_tokens} new tokens per sequence; source length {sizes.length}")
    return result
