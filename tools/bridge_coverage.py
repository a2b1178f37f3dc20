"""Which model types of the installed transformers attnlab opens, and how: the table of docs/pretrained.md.

    python tools/bridge_coverage.py                  # every causal-LM type, table into docs/pretrained.md
    python tools/bridge_coverage.py --seq2seq        # every encoder-decoder type, its table likewise
    python tools/bridge_coverage.py llama gpt_oss    # these types only, printed (docs left alone)
    python tools/bridge_coverage.py --one mixtral    # one type in this process (what each worker runs)

Each type runs in its own process (a memory limit and a timeout, two at a time): a tiny random
model is built from the type's config class (tests/unit/pretrained/tiny_any.py), saved, opened
with ``attnlab.load`` in float64, and checked against transformers' eager model on the same
folder: logits, every layer's pattern, masking one head, KV-cached greedy generation
(``check_bridged``; an encoder-decoder's three kinds of attention: ``check_bridged_seq2seq``).
The row says ``native`` (attnlab's own family, tested in test_hf_families),
``Y`` (bridged, every check passed) or the one-line reason it is not opened. The tests take the
Y rows from the table (tests/unit/pretrained/test_bridge.py).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "pretrained.md"
MARKS = {
    False: ("<!-- bridge-coverage:begin -->", "<!-- bridge-coverage:end -->"),
    True: ("<!-- bridge-seq2seq:begin -->", "<!-- bridge-seq2seq:end -->"),
}
"""Where each table (causal LMs; encoder-decoders) stands in docs/pretrained.md."""
MEMORY = 10 << 30
TIMEOUT = 120
BATCH = 20
"""Types one worker process checks before a fresh one takes over (what tiny models leave behind adds up)."""


def _timed_out(signum: int, frame: Any) -> None:
    raise TimeoutError(f"timed out after {TIMEOUT} s")


def one(model_type: str, seq2seq: bool = False) -> str:
    """Build, open and check ``model_type`` (an encoder-decoder with ``seq2seq``); ``native``, ``Y`` or the reason."""
    import torch

    import attnlab
    from tests.unit.pretrained.tiny_any import build_any, build_seq2seq, check_bridged, check_bridged_seq2seq

    build, check = (build_seq2seq, check_bridged_seq2seq) if seq2seq else (build_any, check_bridged)

    torch.set_num_threads(1)
    stage = "building a tiny model"
    folder_name = "\0"
    try:
        with tempfile.TemporaryDirectory() as folder:
            folder_name = folder
            reference = build(model_type, Path(folder))
            stage = "opening"
            lm = attnlab.load(folder, dtype="float64")
            if not getattr(lm.model, "bridged", False):
                return "native"
            stage = "checking"
            check(reference, lm)
            return "Y"
    except (Exception, TimeoutError) as error:  # noqa: BLE001 - the reason is the row
        message = " ".join(str(error).split()).replace(folder_name, "FOLDER") or type(error).__name__
        return f"{stage}: {type(error).__name__}: {message}"[:240]


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def run(types: list[str], seq2seq: bool = False) -> list[tuple[str, str]]:
    """``types`` checked in worker processes, one after another in each: a worker that dies (out
    of memory) or outlives the timeout of its current type leaves that type's row as the reason,
    and a fresh worker goes on with the rest."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}", "PYTHONWARNINGS": "ignore"}
    results: list[tuple[str, str]] = []
    while len(results) < len(types):
        rest = types[len(results) : len(results) + BATCH]
        worker = subprocess.Popen(
            [sys.executable, __file__, *(["--seq2seq"] if seq2seq else []), "--one", *rest],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
            preexec_fn=_limit,
        )
        assert worker.stdout is not None
        start = time.monotonic()
        for line in worker.stdout:
            if line.startswith("{"):
                row = json.loads(line)
                results.append((row["type"], row["result"]))
                print(f"{row['type']:28s} {time.monotonic() - start:5.1f} s  {row['result']}", flush=True)
                start = time.monotonic()
        worker.wait()
        if worker.returncode != 0 and len(results) < len(types):
            results.append((types[len(results)], f"crashed (exit {worker.returncode}; out of memory or a signal)"))
    return results


def table(results: dict[str, str], seq2seq: bool = False) -> str:
    import transformers

    bridged = sum(r == "Y" for r in results.values())
    native = sum(r == "native" for r in results.values())
    what = "encoder-decoder (seq2seq)" if seq2seq else "causal-LM"
    lines = [
        MARKS[seq2seq][0],
        f"transformers {transformers.__version__}: {len(results)} {what} model types; {native} native, "
        f"{bridged} bridged (every check passed), {len(results) - native - bridged} not opened.",
        "",
        "| model_type | opened | why not |",
        "| --- | --- | --- |",
    ]
    for model_type, result in sorted(results.items()):
        opened = {"Y": "bridge", "native": "native"}.get(result, "no")
        why = "" if opened != "no" else result.replace("|", "\\|")
        lines.append(f"| `{model_type}` | {opened} | {why} |")
    lines.append(MARKS[seq2seq][1])
    return "\n".join(lines)


def bridged_types(doc: Path = DOC, *, seq2seq: bool = False) -> list[str]:
    """The types the table of ``doc`` (the encoder-decoders' with ``seq2seq``) marks as opened through the bridge."""
    text = doc.read_text(encoding="utf-8")
    begin, end = MARKS[seq2seq]
    block = text[text.index(begin) : text.index(end)]
    return [line.split("`")[1] for line in block.splitlines() if line.startswith("| `") and "| bridge |" in line]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("types", nargs="*")
    parser.add_argument("--one")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--seq2seq", action="store_true", help="the encoder-decoder types")
    args = parser.parse_args()
    if args.one:
        signal.signal(signal.SIGALRM, _timed_out)
        for model_type in [args.one, *args.types]:
            signal.alarm(TIMEOUT)
            print(json.dumps({"type": model_type, "result": one(model_type, args.seq2seq)}), flush=True)
            signal.alarm(0)
        return
    sys.path[:0] = [str(ROOT), str(ROOT / "src")]
    from tests.unit.pretrained.tiny_any import causal_types, seq2seq_types

    types = args.types or (seq2seq_types() if args.seq2seq else causal_types())
    chunks = [types[index :: args.jobs] for index in range(args.jobs)]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = dict(row for rows in pool.map(lambda chunk: run(chunk, args.seq2seq), chunks) for row in rows)
    if args.types:
        return
    text = DOC.read_text(encoding="utf-8")
    block = table(results, args.seq2seq)
    begin, end = MARKS[args.seq2seq]
    if begin in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :]
    else:
        text = text + "\n" + block + "\n"
    temporary = DOC.with_suffix(".md.tmp")
    temporary.write_text(text, encoding="utf-8")
    temporary.replace(DOC)


if __name__ == "__main__":
    main()
