"""A tiny random Llama-style language model as a ``pretrained_lm`` run (what ``attnlab import gguf``
writes), for the language-model head analysis tests: byte-level tokens, rotary positions, 6 query
heads sharing 2 key/value heads, RMSNorm, SwiGLU, no biases. Its pad id is also a real token, as
SmolLM2's is, so that padding recognised by its id would show."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from attnlab.experiment import ExperimentConfig, model_config_for_task
from attnlab.nn import build_model
from attnlab.run.directory import RunDir
from attnlab.tasks.registry import build_task
from attnlab.tokenizers import Tokenizer

TEXTS = [
    "the cat sat on the mat",
    "a dog barked",
    "x",  # one token: nothing to predict, skipped
    "colourless green ideas sleep furiously",
    "print(sum(range(10)))",
    "2 + 2 = 4",
]
PAD = ord("e")  # a real and frequent token


def byte_tokenizer() -> Tokenizer:
    """Byte-level BPE without merges: one token per byte, ids = byte values in GPT-2's alphabet."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models
    from tokenizers.pre_tokenizers import ByteLevel

    mapping = _bytes_to_unicode()
    hf = HFTokenizer(models.BPE(vocab={mapping[b]: b for b in range(256)}, merges=[], fuse_unk=False))
    hf.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    return Tokenizer(hf)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for every byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def tiny_lm_run(
    folder: Path,
    *,
    seed: int = 0,
    texts: list[str] | None = None,
    layers: int = 2,
    context: int = 64,
    model: dict[str, Any] | None = None,
) -> tuple[Path, Path]:
    """Write the run (``layers`` layers, a context of ``context`` tokens; ``model`` replaces keys of
    its model section) and a texts file into ``folder``; returns (run, texts file)."""
    folder.mkdir(parents=True, exist_ok=True)
    texts_file = folder / "texts.txt"
    texts_file.write_text("\n".join(TEXTS if texts is None else texts) + "\n", encoding="utf-8")
    tokenizer = byte_tokenizer()
    model_section = {
        "kind": "decoder_only",
        "layers": layers,
        "d_model": 24,
        "heads": 6,
        "kv_heads": 2,
        "d_ff": 32,
        "positional": "rope",
        "norm": "rms",
        "activation": "swiglu",
        "norm_first": True,
        "bias": False,
        "dropout": 0.0,
        "scale_embeddings": False,
        "max_len": context,
        "tie_embeddings": True,
        **(model or {}),
    }
    task_section = {"name": "pretrained_lm", "max_tokens": context, "eos": PAD, "pad": PAD}
    experiment = ExperimentConfig(task=task_section, model=model_section)
    task, _ = build_task(experiment.task, saved_tokenizer=tokenizer)
    torch.manual_seed(seed)
    built = build_model(model_config_for_task(experiment, task))
    with torch.no_grad():  # larger random weights than the initialisation, so every head matters
        for name, parameter in built.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
            else:
                parameter.normal_(0.0, 0.3)
    run = RunDir.create(folder / "run")
    with run.lock():
        run.write_config(experiment.to_dict())
        run.write_tokenizer(tokenizer.to_json())
        run.save_weights(built)
    return run.path, texts_file
