"""The growth of a process's resident set size during a call, read from Linux's ``/proc/self``.

Standard library only: attnlab's harness (:func:`attnlab.bench.harness.peak_rss_growth`) imports it
as ``attnlab.bench.peer_scripts.rss_peak``, and a peer script of this folder, run by a Python
without attnlab, as ``rss_peak`` (its folder comes first on ``sys.path``). Each sets glibc's
allocator first, with its own calls.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["high_water_growth"]


def high_water_growth(run: Callable[[], object]) -> int | None:
    """The peak resident set size during ``run()`` above the RSS before it, in bytes.

    Args:
        run: the call measured.

    Returns:
        The growth, or None where Linux's ``/proc/self/clear_refs`` (which restarts the high-water
        mark) is missing or refused (``run`` is not called then).
    """
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        return None
    before = _status_bytes("VmRSS")
    run()
    return max(0, _status_bytes("VmHWM") - before)


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")
