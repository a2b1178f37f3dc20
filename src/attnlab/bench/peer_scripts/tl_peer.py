"""TransformerLens' side of ``attnlab bench tl``: a script any Python runs, ``PYTHON tl_peer.py``.

This file imports only the standard library, torch, transformers, transformer_lens and its
standalone sibling :mod:`~attnlab.bench.peer_scripts.rss_peak`: it runs in an environment that has
TransformerLens and not attnlab (``attnlab bench tl --python PATH``), or in attnlab's own (the
default, ``sys.executable``). attnlab (:mod:`attnlab.bench.tl`) imports its :class:`TlModel` and
:func:`load_bridge` too, for ``bench bridge`` and ``bench gpu``, which run TransformerLens in their
own process; so transformers and transformer_lens are imported where they are used, and attnlab's
process loads them only for those benchmarks.

The protocol (:class:`attnlab.bench.peer.PeerProcess` is the other end): one JSON object a line each
way, stdout flushed after every line (anything else the libraries print goes to stderr).

1. Started, the peer imports TransformerLens and answers ``{"versions": {...}}`` (a missing module
   ends it at once with ``ModuleNotFoundError`` on stderr, before the model is even written).
2. ``{"op": "load", "folder", "threads", "keep_freed_memory", "tokens", "clean", "corrupt", "answer",
   "layers", "heads", "new_tokens"}``: the Hugging Face folder attnlab's bench wrote, torch's thread
   count, glibc's mmap and trim thresholds of ``attnlab bench``'s process
   (``attnlab.runtime.keep_freed_memory``), the token ids (lists), the patching's answer, the
   model's layers and heads, the tokens to generate. It loads every
   TransformerLens model it can (the bridge; ``HookedTransformer`` where TransformerLens is 3.x) and
   answers ``{"systems": [...]}``.
3. ``{"op": "time", "system", "task"}``: one call of the task, timed by the peer's own clock (the
   pipe's round trip left out), answered ``{"system", "task", "seconds", "units", "output"}``: units
   is the number of heads a patching slice patched (:func:`patch_slices`), else 1; output is what
   attnlab compares: the cached bytes, the (layers, heads) importance, ``[layer, head, value]`` of
   each head patched, or null. JSON's floats are Python's repr, so every value arrives exactly.
4. ``{"op": "peak", "system", "task"}``: one more call under :func:`peak_rss_growth`, answered
   ``{"system", "task", "peak_bytes"}`` (null off Linux's glibc).
5. ``{"op": "quit"}`` or the end of stdin: exit 0.

attnlab sends one request at a time and waits for its answer, so the two processes never compute at
once: attnlab's interleaved rounds time one system at a time, as in one process. Any failure is a
traceback on stderr and a non-zero exit, which attnlab reports with the last line of stderr.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.nn.functional as F

if __package__:  # imported by attnlab, as attnlab.bench.peer_scripts.tl_peer
    from attnlab.bench.peer_scripts.rss_peak import high_water_growth
else:  # run as a script by a Python without attnlab: this folder comes first on sys.path
    from rss_peak import high_water_growth

__all__ = [
    "PATCH_SLICES",
    "TASKS",
    "TlModel",
    "load_bridge",
    "load_hooked_transformer",
    "load_systems",
    "main",
    "nbytes",
    "patch_slices",
    "peak_rss_growth",
    "serve",
]

TASKS = ("cache all", "cache patterns", "patch heads", "importance", "generate")
PATCH_SLICES = 15
"""TransformerLens patches one forward per head: each timed call patches 1/15 of the heads."""


def load_bridge(folder: Path | str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Any:
    """TransformerLens' ``TransformerBridge`` over the folder's Hugging Face model.

    Args:
        folder: a Hugging Face model folder (weights, config, tokenizer).
        device: where the model runs.
        dtype: the model's dtype.

    Returns:
        The bridge in eval mode, or None where TransformerLens is not installed.
    """
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


def load_hooked_transformer(folder: Path | str) -> Any:
    """TransformerLens 3.x's ``HookedTransformer`` with the folder's Llama weights, unprocessed (no
    folded norms, no centring: the weights attnlab runs).

    Args:
        folder: a Hugging Face Llama folder.

    Returns:
        The model in eval mode, or None where TransformerLens is absent or 4.x (which removed it).
    """
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


def nbytes(tensors: Any) -> int:
    """The bytes of the tensors' elements."""
    return sum(t.numel() * t.element_size() for t in tensors)


def _next_token_losses(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(B,) mean next-token cross-entropy of each row."""
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none").mean(1)


class TlModel:
    """One TransformerLens model (bridge or HookedTransformer) doing each task of ``bench tl``."""

    def __init__(self, model: Any, layers: int, heads: int) -> None:
        self.model, self.layers, self.heads = model, layers, heads

    @torch.inference_mode()
    def cache_all(self, tokens: torch.Tensor) -> int:
        """``run_with_cache`` of every hook; the bytes cached."""
        _, cache = self.model.run_with_cache(tokens)
        return nbytes(cache.values())

    @torch.inference_mode()
    def cache_patterns(self, tokens: torch.Tensor) -> int:
        """``run_with_cache`` of the attention patterns only; the bytes cached."""
        _, cache = self.model.run_with_cache(tokens, names_filter=lambda name: name.endswith("attn.hook_pattern"))
        return nbytes(cache.values())

    def importance(self, tokens: torch.Tensor) -> torch.Tensor:
        """Michel et al.'s I_h: (layers, heads), through a head mask xi scaling every ``hook_z``."""
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
        forward each, as over all of them), after the clean run it patches from; the answer's
        log-probability of each patched run."""
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
        """Greedy generation with the KV cache, every row making every step."""
        self.model.generate(
            tokens, max_new_tokens=new_tokens, do_sample=False, stop_at_eos=False, use_past_kv_cache=True, verbose=False
        )


def patch_slices(heads: list[tuple[int, int]]) -> Iterator[list[tuple[int, int]]]:
    """The heads in :data:`PATCH_SLICES` slices, cycled forever: each timed call of TransformerLens'
    patching patches the next slice (all of them in every round would take most of an hour on
    SmolLM2's 270 heads), and its figure is the time per head."""
    size = max(1, -(-len(heads) // PATCH_SLICES))
    return itertools.cycle([heads[start : start + size] for start in range(0, len(heads), size)])


# ---- memory: this file cannot import attnlab, so the allocator calls are its own ----------------------------

_M_TRIM_THRESHOLD = -1  # glibc's <malloc.h>
_M_MMAP_THRESHOLD = -3


def _glibc() -> Any:
    """The process's C library where it is glibc on Linux, else None."""
    if platform.system() != "Linux" or not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
        return None
    libc = ctypes.CDLL(None)
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return libc


def _mallopt(settings: list[list[int]]) -> bool:
    """glibc's ``mallopt`` for each [parameter, value]; whether every one took."""
    libc = _glibc()
    return libc is not None and all(libc.mallopt(parameter, value) == 1 for parameter, value in settings)


def peak_rss_growth(run: Callable[[], object]) -> int | None:
    """The peak resident set size during ``run()`` above the RSS before it, in bytes, as attnlab's
    ``attnlab.bench.harness.peak_rss_growth`` measures it (every block of 128 KiB or more mapped on
    its own, the heap's free pages returned first, the high-water mark restarted); None off glibc
    or without ``/proc/self/clear_refs``."""
    if not _mallopt([[_M_MMAP_THRESHOLD, 128 * 1024]]):
        return None
    _glibc().malloc_trim(0)
    return high_water_growth(run)


# ---- the peer process ----------------------------------------------------------------------------------------


def _tasks(model: TlModel, spec: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    """Each task of one system on the spec's inputs."""
    tokens, clean, corrupt = (torch.tensor(spec[key]) for key in ("tokens", "clean", "corrupt"))
    slices = patch_slices([(layer, head) for layer in range(spec["layers"]) for head in range(spec["heads"])])
    return {
        "cache all": lambda: model.cache_all(tokens),
        "cache patterns": lambda: model.cache_patterns(tokens),
        "patch heads": lambda: model.patch_heads(clean, corrupt, spec["answer"], next(slices)),
        "importance": lambda: model.importance(tokens),
        "generate": lambda: model.generate(tokens, spec["new_tokens"]),
    }


def _output(task: str, value: Any) -> tuple[int, Any]:
    """(units of work, the JSON form) of what a task returned."""
    if task == "patch heads":
        return len(value), [[layer, head, found] for (layer, head), found in value.items()]
    if isinstance(value, torch.Tensor):
        return 1, value.tolist()
    return 1, value


def load_systems(spec: dict[str, Any]) -> Systems:
    """Every TransformerLens model this install has, each with its tasks, on a ``load`` request."""
    torch.set_num_threads(spec["threads"])
    keep = spec["keep_freed_memory"]
    _mallopt([[_M_MMAP_THRESHOLD, keep["mmap_threshold"]], [_M_TRIM_THRESHOLD, keep["trim_threshold"]]])
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    models = {"bridge": load_bridge(spec["folder"]), "HookedTransformer": load_hooked_transformer(spec["folder"])}
    return {
        name: _tasks(TlModel(model, spec["layers"], spec["heads"]), spec)
        for name, model in models.items()
        if model is not None
    }


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "transformer_lens": version("transformer-lens"),
    }


def _protocol_stream() -> TextIO:
    """A stream on the process's stdout for the protocol; stdout itself (Python's and the C
    libraries') then writes to stderr, so that nothing a library prints mixes with the answers."""
    stream = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return stream


Systems = dict[str, dict[str, Callable[[], Any]]]
"""system -> task -> one call of it."""


def serve(
    requests: TextIO, answers: TextIO, versions: dict[str, str], load: Callable[[dict[str, Any]], Systems]
) -> None:
    """Answer each request line of the module docstring until ``quit`` or the end of ``requests``.

    Args:
        requests: the request lines.
        answers: where each answer goes, one line, flushed.
        versions: the first answer's.
        load: the systems of a ``load`` request (:func:`load_systems`).
    """

    def answer(message: dict[str, Any]) -> None:
        answers.write(json.dumps(message) + "\n")
        answers.flush()

    answer({"versions": versions})
    systems: dict[str, dict[str, Callable[[], Any]]] = {}
    for line in iter(requests.readline, ""):
        request = json.loads(line)
        op = request["op"]
        if op == "quit":
            return
        if op == "load":
            systems = load(request)
            answer({"systems": list(systems)})
            continue
        run = systems[request["system"]][request["task"]]
        found = {"system": request["system"], "task": request["task"]}
        if op == "time":
            start = time.perf_counter()
            value = run()
            seconds = time.perf_counter() - start
            units, output = _output(request["task"], value)
            answer({**found, "seconds": seconds, "units": units, "output": output})
        elif op == "peak":
            answer({**found, "peak_bytes": peak_rss_growth(run)})
        else:
            raise ValueError(f"unknown request {op!r}")


def main() -> None:
    """The peer process: requests on stdin, answers on stdout."""
    answers = _protocol_stream()
    # Imported here, not at the top: attnlab imports this module in its own process (see above). A
    # missing TransformerLens (or a module it needs) ends the peer here with ModuleNotFoundError.
    import transformer_lens.model_bridge  # noqa: F401

    serve(sys.stdin, answers, _versions(), load_systems)


if __name__ == "__main__":
    main()
