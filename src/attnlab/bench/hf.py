"""``hf``: Hugging Face checkpoints opened by attnlab against transformers and TransformerLens, in one run.

Each model is built locally with random weights by transformers' own config class and written with
``save_pretrained`` in bf16 into a temporary folder (nothing is downloaded): a tiny model of each
family, and, without ``--quick``, a model of each family at a real size (:data:`MODELS`). On each
folder, attnlab is measured against its reference (the pairs of 1, 3 and 4 timed in interleaved
rounds, :func:`interleaved_median_times`):

1. opening and the first logits: :func:`attnlab.pretrained.sources.open_model` and one forward,
   against ``AutoModelForCausalLM.from_pretrained`` and one forward (both keep the stored bf16;
   Hugging Face's attention is its default, PyTorch's SDPA);
2. peak RSS while opening, each system in a fresh process: the child imports torch and the
   system's own modules, resets its high-water mark (``5`` into ``/proc/self/clear_refs``), reads
   its RSS, opens the folder, reads ``VmHWM``, computes the logits of 8 tokens and reads ``VmHWM``
   again. The figures are the peaks above the RSS after the imports (what opening itself costs),
   as multiples of the weights' bytes in the file: up to the open model, and up to the first
   logits (the target's: weights read lazily from a memory map are resident only once used). The
   RSS after the imports, and before them with torch imported, are reported;
   so is the time from importing the system's modules (torch already imported) to the first
   logits in that fresh process (one run each: what a user's first command waits for, the
   imports and the per-process work of the first calls included, which the warmed-up medians of
   1. leave out);
3. prefill (one forward over batches of 1 and 8 prompts of 128 tokens) and greedy decoding
   (32 new tokens from 16-token prompts, batches 1 and 8: :func:`generate_continuations`
   against ``generate(do_sample=False)``), in float32 and bfloat16 on the CPU. End-of-sequence is
   banned in attnlab and Hugging Face must make ``min_new_tokens``, so both make every step;
4. a forward with every site cached (``attnlab.trace(model, "*")``) against TransformerLens'
   ``run_with_cache`` on a ``TransformerBridge`` booted on the same folder's Hugging Face model
   (TransformerLens 4 replaced ``HookedTransformer`` by the bridge, which hooks the Hugging Face
   modules themselves), and with every site but each head's ``result`` (z_h W_O^h, B x H x T x
   d_model per layer, which TransformerLens computes only with ``use_attn_result``): the
   like-for-like pair. TransformerLens is the ``bench-tl`` extra; without it these pairs are skipped.

A model attnlab cannot open yet is skipped with a note naming the reason (after a tiny one, its
family's larger model is then not built). ``--quick`` builds the tiny models only, with short
prompts, and measures 2. on the first of them only: a smoke test of every path.
Ratios are named ``MODEL.what`` (``MODEL.DTYPE.what`` for the speeds); greater is better for the
speed ratios (Hugging Face's time over attnlab's), smaller for the open time and the RSS.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from attnlab.bench.harness import BenchResult, hf_greedy_generate, interleaved_median_times
from attnlab.errors import AttnlabError
from attnlab.generate.search import DecodeOptions, generate_continuations
from attnlab.kernels.linear import MIN_ONEDNN_ROWS
from attnlab.nn import trace
from attnlab.nn.hooks import model_sites
from attnlab.pretrained.sources import open_model

__all__ = ["MODELS", "HfSizes", "build_checkpoint", "open_rss", "run_hf"]

BOS, EOS, PAD = 0, 1, 2
TOKENIZER_VOCAB = 320

_TINY_CORE = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 32, "intermediate_size": 48}
MODELS: dict[str, dict[str, dict[str, Any]]] = {
    "gpt2": {
        "tiny": {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 256, "vocab_size": TOKENIZER_VOCAB},
        # GPT-2 small (124M): 12 layers, d 768, 12 heads, vocabulary 50257, tied embeddings.
        "124M": {"n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024, "vocab_size": 50257},
    },
    "llama": {
        "tiny": {
            **_TINY_CORE,
            "num_key_value_heads": 2,
            "max_position_embeddings": 256,
            "vocab_size": TOKENIZER_VOCAB,
        },
        # Llama 3.2 1B: 16 layers, d 2048, 32 heads (8 for keys and values), d_ff 8192, vocabulary
        # 128256, tied embeddings, rope base 500000 with llama3 scaling.
        "1B": {
            "num_hidden_layers": 16,
            "hidden_size": 2048,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "intermediate_size": 8192,
            "vocab_size": 128256,
            "max_position_embeddings": 131072,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "tie_word_embeddings": True,
        },
    },
    "gemma2": {
        "tiny": {
            **_TINY_CORE,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "max_position_embeddings": 256,
            "sliding_window": 16,
            "vocab_size": TOKENIZER_VOCAB,
        },
        # Gemma 2 2B's layers (d 2304, 8 heads of 256, 4 for keys and values, d_ff 9216, window
        # 4096, soft-capping) with 13 of its 26 layers and a 32768-token vocabulary instead of
        # 256000: about 1.1B parameters, the Llama's size, so that both fit beside Hugging Face's copy.
        "1B": {
            "num_hidden_layers": 13,
            "hidden_size": 2304,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "intermediate_size": 9216,
            "vocab_size": 32768,
            "max_position_embeddings": 8192,
            "sliding_window": 4096,
        },
    },
}
"""family (a ``model_type``) -> size label -> the keyword arguments of its transformers config."""


@dataclass(frozen=True)
class HfSizes:
    """What each model is timed on: prefill prompts, decoding prompts and new tokens, batch sizes."""

    prompt_tokens: int
    decode_prompt_tokens: int
    new_tokens: int
    batches: tuple[int, ...]


FULL = HfSizes(prompt_tokens=128, decode_prompt_tokens=16, new_tokens=32, batches=(1, 8))
QUICK = HfSizes(prompt_tokens=8, decode_prompt_tokens=4, new_tokens=2, batches=(2,))
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ---- the checkpoints ---------------------------------------------------------------------------------------


def _save_tokenizer(folder: Path) -> None:
    """A small byte-level BPE tokenizer.json (``TOKENIZER_VOCAB`` ids; BOS, EOS, PAD first) in ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,  # its bar wrote blank lines on stdout, into a --json answer
    )
    tokenizer.train_from_iterator(
        ["the quick brown fox jumps over the lazy dog", "def f(x): return x + 1"] * 20, trainer
    )
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    wrapped.save_pretrained(folder)


def build_checkpoint(family: str, size: str, folder: Path) -> int:
    """A random ``family`` model of ``size`` (:data:`MODELS`) saved into ``folder`` in bf16, with a
    tokenizer; returns the bytes of its weights (tied tensors once)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _save_tokenizer(folder)
    config = AutoConfig.for_model(family, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, **MODELS[family][size])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    gc.collect()
    return weights


# ---- 1. opening and the first logits ----------------------------------------------------------------------


def _open_time(result: BenchResult, label: str, folder: Path, repeats: int) -> None:
    from transformers import AutoModelForCausalLM

    tokens = _tokens(1, 8, seed=1)

    @torch.inference_mode()
    def attnlab_open() -> None:
        loaded = open_model(folder)
        loaded.model(tokens)

    @torch.inference_mode()
    def hf_open() -> None:
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        model(input_ids=tokens)

    times = interleaved_median_times({"attnlab": attnlab_open, "hf": hf_open}, repeats=repeats)
    result.add(f"attnlab {label}", "open_first_logits_s", times["attnlab"], "s")
    result.add(f"hf {label}", "open_first_logits_s", times["hf"], "s")
    result.ratios[f"{label}.open_vs_hf"] = times["attnlab"] / times["hf"]
    result.targets[f"{label}.open_vs_hf"] = ("<=", 1.5)


# ---- 2. peak RSS while opening ------------------------------------------------------------------------------

_RSS_SCRIPT = """\
import json, sys, time
import torch
system, folder = sys.argv[1], sys.argv[2]
def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {key: int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM")}
report = {"torch": status()["VmRSS"]}
start = time.perf_counter()  # the system's own imports are part of a first command's wait
if system == "attnlab":
    from attnlab.pretrained.sources import open_model
else:
    from transformers import AutoModelForCausalLM
with open("/proc/self/clear_refs", "w") as clear:
    clear.write("5")  # the high-water mark restarts from the RSS now: the imports' peak is not counted
report["before"] = status()["VmRSS"]
model = open_model(folder).model if system == "attnlab" else AutoModelForCausalLM.from_pretrained(folder)
report["opened"] = status()["VmHWM"]
with torch.inference_mode():
    model(torch.full((1, 8), 3))
report["seconds"] = time.perf_counter() - start
report["peak"] = status()["VmHWM"]
print(json.dumps(report))
"""


def open_rss(system: str, folder: Path) -> dict[str, int]:
    """Resident set sizes in bytes of a fresh process that opens ``folder`` with ``system``
    (``attnlab`` or ``hf``) and computes the logits of 8 tokens: ``torch`` (with torch imported),
    ``before`` (after the system's imports too), ``opened`` (the peak up to the open model) and
    ``peak`` (up to the first logits); and ``seconds`` from the system's imports to the first logits."""
    out = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, system, str(folder)], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"opening {folder} with {system} in a fresh process failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _open_rss(result: BenchResult, label: str, folder: Path, weights: int) -> None:
    seconds, torch_only = {}, []
    for system in ("attnlab", "hf"):
        rss = open_rss(system, folder)
        seconds[system] = rss["seconds"]
        torch_only.append(rss["torch"])
        result.add(f"{system} {label}", "fresh_process_open_first_logits_s", rss["seconds"], "s")
        result.add(f"{system} {label}", "peak_rss_to_first_logits", rss["peak"] / 1e6, "MB")
        result.add(f"{system} {label}", "rss_after_imports", rss["before"] / 1e6, "MB")
        prefix = f"{label}." if system == "attnlab" else f"{label}.hf_"
        result.ratios[f"{prefix}open_rss_vs_weights"] = (rss["opened"] - rss["before"]) / weights
        result.ratios[f"{prefix}first_logits_rss_vs_weights"] = (rss["peak"] - rss["before"]) / weights
    result.targets[f"{label}.first_logits_rss_vs_weights"] = ("<=", 1.3)
    result.ratios[f"{label}.fresh_process_open_vs_hf"] = seconds["attnlab"] / seconds["hf"]
    result.add(f"python {label}", "rss_with_torch_imported", min(torch_only) / 1e6, "MB")


# ---- 3. prefill and decoding; 4. every site cached ----------------------------------------------------------


def _tokens(batch: int, length: int, *, seed: int) -> torch.Tensor:
    """Random ids of the tokenizer's ordinary tokens (past BOS, EOS, PAD), the same for every system."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, TOKENIZER_VOCAB, (batch, length), generator=generator)


def _speeds(result: BenchResult, label: str, folder: Path, sizes: HfSizes, repeats: int) -> None:
    from transformers import AutoModelForCausalLM

    for dtype_name, dtype in DTYPES.items():
        name = f"{label}.{dtype_name}"
        model = open_model(folder, dtype=dtype).model
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        _prefill(result, name, model, hf, sizes, repeats)
        _decode(result, name, model, hf, sizes, repeats)
        del hf
        gc.collect()
        _cached_forward(result, name, model, folder, dtype, sizes, repeats)
        del model
        gc.collect()


def _prefill(result: BenchResult, name: str, model, hf, sizes: HfSizes, repeats: int) -> None:  # noqa: ANN001
    for batch in sizes.batches:
        tokens = _tokens(batch, sizes.prompt_tokens, seed=2)

        @torch.inference_mode()
        def attnlab_prefill(tokens: torch.Tensor = tokens) -> None:
            model(tokens)

        @torch.inference_mode()
        def hf_prefill(tokens: torch.Tensor = tokens) -> None:
            hf(input_ids=tokens, use_cache=False)

        times = interleaved_median_times({"attnlab": attnlab_prefill, "hf": hf_prefill}, repeats=repeats)
        metric = f"{name}.prefill_tokens_per_s_batch{batch}"
        result.add("attnlab", metric, tokens.numel() / times["attnlab"], "tokens/s")
        result.add("hf", metric, tokens.numel() / times["hf"], "tokens/s")
        result.ratios[f"{name}.prefill_vs_hf_batch{batch}"] = times["hf"] / times["attnlab"]
        result.targets[f"{name}.prefill_vs_hf_batch{batch}"] = (">=", _speed_target(model, "prefill", 1.2, batch))


def _decode(result: BenchResult, name: str, model, hf, sizes: HfSizes, repeats: int) -> None:  # noqa: ANN001
    options = DecodeOptions(max_length=sizes.new_tokens)
    for batch in sizes.batches:
        tokens = _tokens(batch, sizes.decode_prompt_tokens, seed=3)
        prompts = tokens.tolist()

        def attnlab_decode(prompts: list[list[int]] = prompts) -> None:
            generate_continuations(model, prompts, eos_id=EOS, banned=(EOS,), options=options)

        def hf_decode(tokens: torch.Tensor = tokens) -> None:
            hf_greedy_generate(hf, tokens, sizes.new_tokens, eos_token_id=EOS, pad_token_id=PAD)

        times = interleaved_median_times({"attnlab": attnlab_decode, "hf generate": hf_decode}, repeats=repeats)
        metric = f"{name}.decode_tokens_per_s_batch{batch}"
        result.add("attnlab", metric, batch * sizes.new_tokens / times["attnlab"], "tokens/s")
        result.add("hf generate", metric, batch * sizes.new_tokens / times["hf generate"], "tokens/s")
        result.ratios[f"{name}.decode_vs_hf_batch{batch}"] = times["hf generate"] / times["attnlab"]
        result.targets[f"{name}.decode_vs_hf_batch{batch}"] = (">=", _speed_target(model, "decode", 1.5, batch))


def _speed_target(model, what: str, where_kernels_apply: float, batch: int) -> float:  # noqa: ANN001
    """The speed-up asked of attnlab: ``where_kernels_apply`` where its own kernels run the maps
    (float32: the measured GEMM choice and the few-rows kernel; bfloat16: the few-rows kernel, for
    a decoding step of fewer than MIN_ONEDNN_ROWS rows, whose weights are stored as W, not W^T),
    else parity (1.0): a bf16 prefill or a bf16 decoding step of many rows runs oneDNN's bf16 GEMM
    in both systems, and GPT-2's maps keep Conv1D's W^T, which both systems multiply with
    PyTorch's bf16 product (a few-rows kernel reading W^T in place measured slower in the model:
    benchmarks/README.md)."""
    dtype = next(model.parameters()).dtype
    if dtype == torch.float32:
        return where_kernels_apply
    if what == "decode" and batch < MIN_ONEDNN_ROWS and _maps_stored_as_w(model):
        return where_kernels_apply
    return 1.0


def _maps_stored_as_w(model) -> bool:  # noqa: ANN001
    """Whether the layers' linear maps hold W (d_out, d_in) row-major, as the few-rows kernel reads it."""
    weights = [p for name, p in model.named_parameters() if p.dim() == 2 and ".layers." in name]
    return all(w.is_contiguous() for w in weights)


def _transformer_lens_bridge(folder: Path, dtype: torch.dtype):  # noqa: ANN202
    """TransformerLens' bridge over the folder's Hugging Face model (its own copy: the bridge switches
    the model to eager attention), or None without the ``bench-tl`` extra."""
    try:
        from transformer_lens.model_bridge import TransformerBridge
    except ImportError:
        return None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return TransformerBridge.boot_transformers(str(folder), hf_model=hf, tokenizer=tokenizer, device="cpu", dtype=dtype)


def _cached_forward(
    result: BenchResult,
    name: str,
    model,
    folder: Path,
    dtype: torch.dtype,
    sizes: HfSizes,
    repeats: int,  # noqa: ANN001
) -> None:
    bridge = _transformer_lens_bridge(folder, dtype)
    tokens = _tokens(1, sizes.prompt_tokens, seed=4)
    counts: dict[str, int] = {}

    # TransformerLens computes each head's term z_h W_O^h (hook_result) only when asked
    # (use_attn_result): the like-for-like pair caches every site but that one.
    without_result = [name for name in model_sites(model) if not name.endswith(".result")]

    @torch.inference_mode()
    def attnlab_cached() -> None:
        with trace(model, "*") as traced:
            model(tokens)
        counts["attnlab"] = len(traced.cache)

    @torch.inference_mode()
    def attnlab_cached_without_result() -> None:
        with trace(model, without_result) as traced:
            model(tokens)
        counts["attnlab without result"] = len(traced.cache)

    @torch.inference_mode()
    def transformer_lens_cached() -> None:
        _, cache = bridge.run_with_cache(tokens)
        counts["transformer_lens"] = len(cache)

    systems = {"attnlab trace *": attnlab_cached, "attnlab trace * but result": attnlab_cached_without_result}
    if bridge is not None:
        systems["transformer_lens run_with_cache"] = transformer_lens_cached
    times = interleaved_median_times(systems, repeats=repeats)
    metric = f"{name}.cached_forward_s"
    for system, seconds in times.items():
        result.add(system, metric, seconds, "s")
    if bridge is None:
        result.notes.append(f"{name}: TransformerLens is not installed (the bench-tl extra): run_with_cache skipped")
        return
    ratio = f"{name}.cached_forward_vs_transformer_lens"
    result.ratios[ratio] = times["transformer_lens run_with_cache"] / times["attnlab trace *"]
    result.ratios[f"{ratio}_without_result"] = (
        times["transformer_lens run_with_cache"] / times["attnlab trace * but result"]
    )
    result.targets[f"{ratio}_without_result"] = (">=", 1.0)
    result.notes.append(
        f"{name}: tensors cached in one forward: attnlab {counts['attnlab']} sites "
        f"({counts['attnlab without result']} without each head's result), "
        f"TransformerLens {counts['transformer_lens']} hook points (no per-head result)"
    )


# ---- the benchmark -------------------------------------------------------------------------------------------


def _opens(folder: Path) -> str | None:
    """None where attnlab opens ``folder``; else the one-line reason."""
    try:
        open_model(folder)
    except (AttnlabError, ValueError, KeyError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def run_hf(quick: bool = False, repeats: int = 5, families: tuple[str, ...] | None = None) -> BenchResult:
    """Every measurement of the module docstring, on every family's models (tiny ones only with ``quick``).

    Args:
        families: only these ``model_type`` values of :data:`MODELS` (default: all).
    """
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # a bar for every opening: the report is the output
    sizes = QUICK if quick else FULL
    result = BenchResult("hf")
    for family in families or tuple(MODELS):
        labels = list(MODELS[family])[: 1 if quick else None]
        for size in labels:
            label = f"{family}-{size}"
            with tempfile.TemporaryDirectory(prefix="attnlab-bench-hf-") as tmp:
                folder = Path(tmp)
                weights = build_checkpoint(family, size, folder)
                reason = _opens(folder)
                if reason is not None:
                    result.notes.append(f"{label}: skipped, attnlab does not open it yet ({reason})")
                    break
                _open_time(result, label, folder, repeats)
                if not quick or not any(m.metric == "peak_rss_to_first_logits" for m in result.results):
                    _open_rss(result, label, folder, weights)  # --quick: once, as every family's path is one
                _speeds(result, label, folder, sizes, repeats)
                result.notes.append(f"{label}: {weights / 1e6:.1f} MB of bf16 weights")
    result.notes.append(
        f"prefill: batches {sizes.batches} x {sizes.prompt_tokens} tokens; decoding: {sizes.new_tokens} new tokens "
        f"after {sizes.decode_prompt_tokens}-token prompts; cached forward: 1 x {sizes.prompt_tokens} tokens"
    )
    result.notes.append(
        "RSS: a fresh process's peak above its RSS after importing torch and the system's modules "
        "(VmHWM reset by /proc/self/clear_refs), over the weights' bytes; up to the open model and to the first logits"
    )
    return result
