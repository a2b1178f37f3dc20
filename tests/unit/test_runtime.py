"""attnlab.runtime.keep_freed_memory: glibc's malloc serves large blocks from its heap and keeps
them there once freed, as it does not by default (checked through glibc's own counts, mallinfo2)."""

from __future__ import annotations

import ctypes.util
import json
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="mallopt thresholds are glibc's"
)

# In a fresh process each: the settings are process-wide. Four 20 MiB tensors are allocated, then freed.
PROBE = """
import ctypes, ctypes.util, json, sys
import torch
from attnlab.runtime import keep_freed_memory

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                 "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = Mallinfo2
took = keep_freed_memory() if sys.argv[1] == "keep" else None
before = libc.mallinfo2()
free_before, mapped_before = before.fordblks, before.hblkhd
blocks = [torch.ones(5 * 2**20) for _ in range(4)]
mapped = libc.mallinfo2().hblkhd - mapped_before
del blocks
kept = libc.mallinfo2().fordblks - free_before
print(json.dumps({"took": took, "mapped_while_live": mapped, "kept_after_free": kept}))
"""


def _probe(mode: str) -> dict:
    result = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)


@pytest.mark.skipif(not hasattr(ctypes.CDLL(ctypes.util.find_library("c")), "mallinfo2"), reason="glibc < 2.33")
def test_large_blocks_come_from_the_heap_and_stay_there():
    mib80 = 4 * 20 * 2**20
    default, kept = _probe("default"), _probe("keep")
    # Other small allocations move the heap's free bytes by a few hundred kB either way.
    assert default["mapped_while_live"] >= mib80 and default["kept_after_free"] < mib80 / 4  # unmapped on free
    assert kept["took"] is True
    assert kept["mapped_while_live"] == 0 and kept["kept_after_free"] >= 3 * mib80 / 4  # kept for the next step


def test_the_library_does_not_change_the_process_on_import():
    """Only the train and bench commands call it: importing attnlab leaves malloc as it was."""
    probe = PROBE.replace(
        "from attnlab.runtime import keep_freed_memory", "import attnlab, attnlab.runtime, attnlab.training.trainer"
    )
    probe = probe.replace('took = keep_freed_memory() if sys.argv[1] == "keep" else None', "took = None")
    result = subprocess.run([sys.executable, "-c", probe, "default"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["mapped_while_live"] >= 4 * 20 * 2**20


# Blocks of 64 KiB (below the mmap threshold: from the heap), every other one freed: free pages
# between live blocks, which no threshold returns. Written first, so they are resident.
TRIM_PROBE = """
import ctypes, json, os
from attnlab.runtime import release_freed_memory

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
page = os.sysconf("SC_PAGE_SIZE")

def resident():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * page

blocks = [libc.malloc(65536) for _ in range(2000)]
for block in blocks:
    ctypes.memset(block, 1, 65536)
for block in blocks[::2]:
    libc.free(block)
before = resident()
ran = release_freed_memory()
print(json.dumps({"ran": ran, "released": before - resident()}))
"""


def test_release_freed_memory_returns_free_pages_between_live_blocks():
    run = subprocess.run([sys.executable, "-c", TRIM_PROBE], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout)
    assert result["ran"] is True
    assert result["released"] >= 40 * 2**20  # of the 62.5 MiB freed (each free block keeps a page or so)


def test_release_freed_memory_does_nothing_off_glibc(monkeypatch):
    import attnlab.runtime as runtime

    monkeypatch.setattr(runtime.os, "confstr", lambda name: "musl")
    assert runtime.release_freed_memory() is False
