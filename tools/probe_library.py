"""The probe's cases of issue 50: where the command line's checks did not reach.

* ``python api``: ``attnlab.load`` / ``lm.generate`` / ``lm(...)`` with hostile values, each in a
  Python process of its own with a timeout: it must raise an ``AttnlabError`` subclass (one line)
  within :data:`CALL_SECONDS`, not run without end nor end in PyTorch's or Python's own error;
* ``hf config``: a tiny Hugging Face folder (tests/unit/pretrained/tiny_hf.py) with one hostile
  field or tensor, opened by ``attnlab generate``: refused with one ``error:`` line (2 or 3), or,
  where the issue allows it (a tensor stored as F64 converted on reading, a legacy rope_scaling
  read as transformers reads it), run without a crash and, for rope, with transformers' logits;
* ``files``: a permission-denied, FIFO, /dev/zero or symlink-loop model.safetensors: named for what
  it is (permission denied, not a regular file, ELOOP), within seconds;
* ``full disk``: ``import hf`` under ``RLIMIT_FSIZE``: one ``error:`` line, exit 2 or 3, and nothing
  left where the run would have been (no half-written run beside it);
* ``orphans``: kill -9 of the parent of an ``eval --texts --nproc 2`` run: no worker left running.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from probe_core import REPO, Case, Outcome, Probe, classify, kill_all, marked

CALL_SECONDS = 20.0
"""The most one hostile call may take before it answers (the process's start and the model's load
aside): "within seconds" on a loaded 2-core machine."""
CONFIG_CODES = (2, 3)
"""A hostile imported config is a usage error (a value over its cap) or a damaged file: both say so."""


# ---- the tiny Hugging Face folder ----------------------------------------------------------------------------


def tiny_hf(probe: Probe) -> Path:
    """A tiny Llama folder of transformers' own writing (built once per probe), every file readable by all."""
    folder = getattr(probe, "tiny_hf_folder", None)
    if folder is None:
        sys.path.insert(0, str(REPO))
        from transformers.utils import logging as transformers_logging

        from tests.unit.pretrained.tiny_hf import build

        transformers_logging.disable_progress_bar()
        folder = probe.folder / "tiny-hf"
        build("llama", folder)
        for path in folder.iterdir():
            path.chmod(0o644)
        probe.tiny_hf_folder = folder
    return folder


def hf_copy(probe: Probe, name: str, *, parent: Path | None = None) -> Path:
    """A copy of the tiny folder to damage, in a fresh folder of the probe's or in ``parent``."""
    parent = parent or probe.fresh(name)
    parent.chmod(0o755)
    folder = Path(shutil.copytree(tiny_hf(probe), parent / "model"))
    folder.chmod(0o755)
    return folder


def _edit_config(folder: Path, change: Callable[[dict], None]) -> None:
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))


def _retype_tensor(folder: Path, suffix: str, dtype: str) -> None:
    """The first tensor whose name ends with ``suffix``, stored again as ``dtype`` (float64, int8)."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    name = next(key for key in tensors if key.endswith(suffix))
    value = tensors[name]
    tensors[name] = (value * 100).round().to(torch.int8) if dtype == "int8" else value.to(getattr(torch, dtype))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _small_vocabulary(folder: Path) -> None:
    """config.json's vocabulary (and the embedding and head) cut to 100 tokens below the tokenizer's 320."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = tensors[name][:100].clone()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    _edit_config(folder, lambda c: c.update(vocab_size=100))


def _big_config(folder: Path) -> None:
    """A config.json of 70 MB (past the 64 MiB cap on one text input)."""
    _edit_config(folder, lambda c: c.update(padding="x" * 70_000_000))


HF_DAMAGE: dict[str, tuple[Callable[[Path], None], str, tuple[str, ...]]] = {
    # name -> (damage, expect, words the error line must hold)
    "num_hidden_layers 1e12": (lambda f: _edit_config(f, lambda c: c.update(num_hidden_layers=10**12)), "error", ()),
    "num_attention_heads 1e12": (
        lambda f: _edit_config(f, lambda c: c.update(num_attention_heads=10**12)),
        "error",
        (),
    ),
    "bos_token_id outside the vocabulary": (
        lambda f: _edit_config(f, lambda c: c.update(bos_token_id=10**6)),
        "error",
        ("bos",),
    ),
    "eos_token_id negative": (lambda f: _edit_config(f, lambda c: c.update(eos_token_id=-5)), "error", ("eos",)),
    "rope_scaling unknown type": (
        lambda f: _edit_config(f, lambda c: c.update(rope_scaling={"rope_type": "bogus", "factor": 2.0})),
        "error",
        ("rope",),
    ),
    "rope_scaling negative factor": (
        lambda f: _edit_config(f, lambda c: c.update(rope_scaling={"rope_type": "linear", "factor": -2.0})),
        "error",
        ("factor",),
    ),
    "rope_scaling a list": (lambda f: _edit_config(f, lambda c: c.update(rope_scaling=[1, 2])), "error", ("rope",)),
    "config.json without model_type": (
        lambda f: _edit_config(f, lambda c: c.pop("model_type")),
        "error",
        ("model_type",),
    ),
    "config.json of 70 MB": (_big_config, "error", ("config.json",)),
    "dtype int8": (lambda f: _edit_config(f, lambda c: c.update(dtype="int8", torch_dtype="int8")), "error", ("int8",)),
    "tokenizer ids beyond the vocabulary": (_small_vocabulary, "error", ("vocab",)),
    "a tensor stored as F64": (lambda f: _retype_tensor(f, "layers.0.mlp.up_proj.weight", "float64"), "either", ()),
    "an int8 q_proj": (lambda f: _retype_tensor(f, "layers.0.self_attn.q_proj.weight", "int8"), "error", ("q_proj",)),
}
"""The hostile configs and tensors of the issue; an ``either`` case may run (converted as transformers
does) or be refused by name, but never crash."""


def _check_words(outcome: Outcome, words: tuple[str, ...], *, forbid: tuple[str, ...] = ()) -> Outcome:
    """A refusal whose line lacks one of ``words`` (case-insensitive) or holds one of ``forbid`` fails."""
    if outcome.result != "ok-error":
        return outcome
    line = outcome.detail.lower()
    lacking = [word for word in words if word.lower() not in line]
    found = [word for word in forbid if word.lower() in line]
    if lacking or found:
        what = f"lacks {lacking}" if lacking else f"says {found}"
        return Outcome("fail", outcome.code, outcome.seconds, f"the line {what}: {outcome.detail}")
    return outcome


def hf_config(how: str) -> Callable[[Probe], Outcome]:
    damage, expect, words = HF_DAMAGE[how]

    def run(probe: Probe) -> Outcome:
        folder = hf_copy(probe, "hf")
        damage(folder)
        outcome = classify(
            *probe.attnlab("generate", folder, "hello", "--max-length", "2", timeout=120),
            expect=expect,
            want=CONFIG_CODES,
        )
        forbid = ("unknown section", "k_proj") if how in ("config.json without model_type", "an int8 q_proj") else ()
        return _check_words(outcome, words, forbid=forbid)

    return run


_ROPE_EQUALS_TRANSFORMERS = """
import sys, torch, attnlab
from attnlab.errors import AttnlabError
from transformers import AutoModelForCausalLM
folder = sys.argv[1]
try:
    lm = attnlab.load(folder, dtype="float64")
except AttnlabError as error:
    print("REFUSED", str(error).splitlines()[0]); sys.exit(0)
ids = torch.tensor([[0, 5, 17, 42, 99, 7, 3, 250, 11, 60, 61, 62]])
ours = lm(ids).double()
theirs = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float64).eval()(ids).logits
print("DIFF", float((ours - theirs).abs().max()))
"""


def legacy_rope_scaling(probe: Probe) -> Outcome:
    """A legacy ``rope_scaling`` (linear, factor 4) beside the default rope: refused by name, or the
    logits transformers gives (within 1e-6 in float64)."""
    folder = hf_copy(probe, "rope")
    _edit_config(folder, lambda c: c.update(rope_scaling={"type": "linear", "factor": 4.0}))
    code, out, err, seconds = probe.run([sys.executable, "-c", _ROPE_EQUALS_TRANSFORMERS, str(folder)], timeout=180)
    if code is None:
        return Outcome("hang", None, seconds, f"no answer after {seconds:.0f} s")
    lines = out.strip().splitlines() or [""]
    if code != 0 or not lines[-1].startswith(("REFUSED", "DIFF")):
        last = ([line for line in err.splitlines() if line.strip()] or [""])[-1]
        return Outcome("crash", code, seconds, last[:300])
    if lines[-1].startswith("REFUSED"):
        return Outcome("ok-error", code, seconds, lines[-1][:300])
    difference = float(lines[-1].split()[1])
    result = "ok" if difference <= 1e-6 else "fail"
    return Outcome(result, code, seconds, f"logits differ from transformers by {difference:.2e}")


# ---- the Python API ------------------------------------------------------------------------------------------

_API_SCRIPT = """
import sys, time, torch, attnlab
from attnlab.errors import AttnlabError
folder = sys.argv[1]
lm = None if {loads} else attnlab.load(folder)
started = time.monotonic()
try:
    result = {call}
    if hasattr(result, "__next__"):
        result = list(result)
except AttnlabError as error:
    took = round(time.monotonic() - started, 1)
    print("ATTNLAB", took, type(error).__name__ + ":", str(error).replace(chr(10), " | "))
    sys.exit(0)
except BaseException as error:  # noqa: BLE001 - the probe reports what it was
    print("OTHER", round(time.monotonic() - started, 1), type(error).__name__ + ":", str(error).splitlines()[:1])
    sys.exit(1)
print("RETURNED", round(time.monotonic() - started, 1), repr(result)[:120])
sys.exit(2)
"""

API_CALLS: dict[str, str] = {
    "load(dtype=torch.int8)": "attnlab.load(folder, dtype=torch.int8)",
    "load(dtype=123)": "attnlab.load(folder, dtype=123)",
    "load(revision=123)": "attnlab.load(folder, revision=123)",
    "load(verify='no')": "attnlab.load(folder, verify='no')",
    "generate(max_new_tokens=10**9)": "lm.generate('hello', max_new_tokens=10**9)",
    "generate(a 20,000-word prompt)": "lm.generate('hello ' * 20000, max_new_tokens=2)",
    "lm(a prompt longer than the context)": "lm('hello ' * 200)",
    "generate(temperature=nan)": "lm.generate('hello', max_new_tokens=2, temperature=float('nan'))",
    "generate(temperature=-1)": "lm.generate('hello', max_new_tokens=2, temperature=-1.0)",
    "generate(seed=-1)": "lm.generate('hello', max_new_tokens=2, temperature=1.0, seed=-1)",
    "lm(float token ids)": "lm(torch.tensor([[1.5, 2.0, 3.0]]))",
}
"""Each hostile call of the issue, run after ``lm = attnlab.load(folder)`` (``load(...)`` calls run alone)."""


def api_call(name: str) -> Callable[[Probe], Outcome]:
    call = API_CALLS[name]

    def run(probe: Probe) -> Outcome:
        script = _API_SCRIPT.format(loads=call.startswith("attnlab.load"), call=call)
        code, out, err, seconds = probe.run([sys.executable, "-c", script, str(tiny_hf(probe))], timeout=120)
        if code is None:
            return Outcome("hang", None, seconds, f"no answer after {seconds:.0f} s")
        lines = out.strip().splitlines() or [""]
        words = lines[-1].split(" ", 2)
        if words[0] not in ("ATTNLAB", "OTHER", "RETURNED"):
            last = ([line for line in err.splitlines() if line.strip()] or [""])[-1]
            return Outcome("crash", code, seconds, last[:300])
        took, detail = float(words[1]), words[2] if len(words) > 2 else ""
        if words[0] == "RETURNED":
            return Outcome("silent-success", code, seconds, f"returned after {took} s: {detail}"[:300])
        if words[0] == "OTHER":
            return Outcome("fail", code, seconds, f"not an AttnlabError: {detail}"[:300])
        if took > CALL_SECONDS:
            return Outcome("fail", code, seconds, f"refused only after {took} s: {detail}"[:300])
        return Outcome("ok-error", code, seconds, detail[:300])

    return run


# ---- files in a model folder ------------------------------------------------------------------------------------


def _as_nobody() -> tuple[str, ...] | None:
    """The prefix that runs a command where a file's mode counts: none for an ordinary user, setpriv
    to nobody for root; None where root cannot change user (the case is then skipped)."""
    if os.geteuid() != 0:
        return ()
    prefix = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
    if shutil.which("setpriv") is None or subprocess.run([*prefix, "true"], check=False).returncode != 0:
        return None
    return prefix


FILE_PLACES: dict[str, tuple[Callable[[Path], None], int, tuple[str, ...]]] = {
    "model.safetensors chmod 000": (lambda path: path.chmod(0), 2, ("permission denied",)),
    "model.safetensors a FIFO": (lambda path: (path.unlink(), os.mkfifo(path)), 3, ("FIFO",)),
    "model.safetensors a symlink to /dev/zero": (
        lambda path: (path.unlink(), path.symlink_to("/dev/zero")),
        3,
        ("not a regular file",),
    ),
    "model.safetensors a symlink loop": (lambda path: (path.unlink(), path.symlink_to(path.name)), 3, ("ELOOP",)),
}


def file_place(how: str) -> Callable[[Probe], Outcome]:
    damage, want, words = FILE_PLACES[how]

    def run(probe: Probe) -> Outcome:
        prefix = _as_nobody() if "chmod" in how else ()
        if prefix is None:
            return Outcome("skipped", None, 0.0, "root, and no way to run as another user")
        shared = Path(tempfile.mkdtemp(prefix="attnlab-probe-file-"))  # every user may enter it (the probe's is 0700)
        try:
            folder = hf_copy(probe, "file", parent=shared)
            damage(folder / "model.safetensors")
            argv = [sys.executable, "-m", "attnlab", "generate", str(folder), "hello", "--max-length", "2"]
            outcome = classify(*probe.run(argv, prefix=prefix, timeout=60), expect="error", want=want)
            return _check_words(outcome, (str(folder / "model.safetensors"), *words), forbid=("no model.safetensors",))
        finally:
            shutil.rmtree(shared, ignore_errors=True)

    return run


# ---- a full disk ---------------------------------------------------------------------------------------------------

_LIMITED = """
import os, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), int(sys.argv[1])))
os.execv(sys.executable, [sys.executable, "-m", "attnlab", *sys.argv[2:]])
"""


def full_disk(limit: int) -> Callable[[Probe], Outcome]:
    """``import hf`` where no file may grow past ``limit`` bytes: one error line, nothing left behind."""

    def run(probe: Probe) -> Outcome:
        folder = hf_copy(probe, "full")
        parent = probe.fresh("full-out")
        out = parent / "run"
        argv = [sys.executable, "-c", _LIMITED, str(limit), "import", "hf", str(folder), "--out", str(out)]
        outcome = classify(*probe.run(argv, timeout=120), expect="error", want=4)  # docs/reliability.md: no room is 4
        left = sorted(path.name for path in parent.iterdir())
        if outcome.result in ("ok-error", "wrong-code") and left:
            return Outcome("fail", outcome.code, outcome.seconds, f"left behind in {parent}: {left}")
        return outcome

    return run


# ---- workers outliving their parent ----------------------------------------------------------------------------


def orphaned_workers(probe: Probe) -> Outcome:
    """kill -9 of the parent of ``eval RUN --texts CORPUS --nproc 2``: its workers must stop too."""
    folder = probe.fresh("orphans")
    corpus = folder / "corpus.txt"
    corpus.write_text(probe.corpus.read_text() * 2000)
    marker = f"ATTNLAB_PROBE_ORPHANS={folder.name}"
    env = {**probe.env, "ATTNLAB_PROBE_ORPHANS": folder.name}
    started = time.monotonic()
    argv = [sys.executable, "-m", "attnlab", "eval", str(probe.lm_run), "--texts", str(corpus), "--nproc", "2"]
    parent = subprocess.Popen([*argv, "--no-progress"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while len(marked(marker)) < 3:  # the parent and its two workers
            if parent.poll() is not None:
                return Outcome("fail", parent.returncode, time.monotonic() - started, "ended before its workers ran")
            if time.monotonic() - started > 120:
                return Outcome("fail", None, time.monotonic() - started, "no two workers after 120 s")
            time.sleep(0.2)
        time.sleep(1.0)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 20
        while marked(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = marked(marker)
        if left:
            names = [Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:80].decode() for pid in left]
            return Outcome("fail", None, time.monotonic() - started, f"left running 20 s after: {names}")
        return Outcome("ok", None, time.monotonic() - started, "no worker left")
    except OSError as error:
        return Outcome("fail", None, time.monotonic() - started, f"{type(error).__name__}: {error}")
    finally:
        kill_all(marker, parent)


# ---- the cases ------------------------------------------------------------------------------------------

LIBRARY_CASES = [
    *(Case(f"python: {name}", "python api", api_call(name), needs=("hf",)) for name in API_CALLS),
    *(Case(f"hf config: {how}", "hf config", hf_config(how), needs=("hf",)) for how in HF_DAMAGE),
    Case("hf config: legacy rope_scaling linear 4", "hf config", legacy_rope_scaling, needs=("hf",)),
    *(Case(f"file: {how}", "files", file_place(how), needs=("hf",)) for how in FILE_PLACES),
    Case("import hf under RLIMIT_FSIZE 64 KiB", "full disk", full_disk(64 * 1024), needs=("hf",)),
    Case("import hf under RLIMIT_FSIZE 4 KiB", "full disk", full_disk(4 * 1024), needs=("hf",)),
    Case("kill -9 the parent of --nproc 2", "orphans", orphaned_workers),
]
"""Issue 50's cases, appended to tools/probe_cli.py's (``needs`` ``hf``: transformers, to write the
tiny folder)."""
