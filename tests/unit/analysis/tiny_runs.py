"""Tiny trained runs for the attention-picture and viewer tests (seconds each on one CPU thread).

Shared by ``tests/unit/analysis``, ``tests/integration/test_viewer*.py`` and ``tests/browser``.
How well they learned does not matter to those tests; only that each is a real run directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attnlab.experiment import ExperimentConfig
from attnlab.training.trainer import train

XSS = '"><img src=x onerror=alert(1)>'
"""An input that would run a script if token text were ever put into the page as HTML."""

_SIZES = {"train_size": 120, "valid_size": 8, "test_size": 8, "length_generalisation_size": 4}
_MODEL = {"layers": 2, "d_model": 16, "heads": 2, "d_ff": 32, "dropout": 0.0}
_TRAIN = {"steps": 12, "batch_size": 16, "lr": 3e-3, "warmup": 4, "log_every": 0}

HELD = ("cross:0:0", "encoder_self:0:1")
"""The heads the ``held`` run holds at zero in training (``train.mask_heads``)."""

_TRAINED: dict[str, Path] = {}
"""kind -> the run trained first in this process; the tests only read runs, so they share them."""


def _experiment(kind: str, corpus: Path) -> dict[str, Any]:
    if kind == "encoder_classifier":
        task = {"name": "dyck1", "max_train_length": 6, **_SIZES}
    elif kind == "decoder_only":
        task = {"name": "lm", "train_file": str(corpus), "tokenizer_kind": "char", "max_train_length": 40}
    else:
        task = {"name": "reverse", "max_train_length": 5, **_SIZES}
    model_kind = "encoder_decoder" if kind in ("hard", "held") else kind
    model = {"kind": model_kind, **_MODEL, **({"attention": "hard"} if kind == "hard" else {})}
    return {"task": task, "model": model, "train": {**_TRAIN, **({"mask_heads": list(HELD)} if kind == "held" else {})}}


def tiny_run(folder: Path, kind: str) -> Path:
    """Train a run of ``kind`` (encoder_decoder, encoder_classifier, decoder_only, hard, or held: an
    encoder-decoder with the heads :data:`HELD` held at zero) in ``folder``.

    The decoder-only run learns characters from a corpus that contains :data:`XSS`, so that the
    payload's characters are real tokens of its vocabulary. A run of the same kind trained earlier
    in this test process (pytest keeps its temporary folders for the session) is reused.
    """
    if kind in _TRAINED and (_TRAINED[kind] / "config.json").exists():
        return _TRAINED[kind]
    folder.mkdir(parents=True, exist_ok=True)
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(["the cat sat on the mat", XSS, "a dog <b> & 'quotes'"] * 20) + "\n", encoding="utf-8")
    path = folder / kind
    train(ExperimentConfig.from_dict(_experiment(kind, corpus)), path, progress=False)
    _TRAINED[kind] = path
    return path
