"""Running a command on N processes: PyTorch's elastic launcher (torchrun), started from the command.

``attnlab train --nproc N`` and the corpus runs (``attnlab eval --texts``, ``attnlab heads
importance | ablate | detect --texts``) run their own command line again on N local processes with
the launcher ``torchrun --standalone --nproc_per_node=N`` runs (:func:`launch`). Each process gets
RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT, and joins the process group with
:func:`attnlab.training.distributed.from_environment`: gloo on the CPU, NCCL on GPUs (one each).

A corpus run spreads over several machines with ``--nnodes M --node-rank R --master-addr HOST
[--master-port P]`` given on each (:class:`Nodes`): torchrun's static rendezvous, as
``torchrun --nnodes M --node-rank R --master-addr HOST --master-port P``; the M x N processes share
one process group, node R's processes taking the global ranks R N .. R N + N - 1. Every machine
reads the same corpus path (a shared file system) and the first process writes the result.

The launcher runs inside this process, not as ``python -m torch.distributed.run``: a process that
fails ends the command with that process's exit code and its own one ``error:`` line, without
the launcher's report and traceback. Errors of the input (a bad line, a bad option) are raised
alike on every process; only the first prints them (:func:`quiet_error`).
"""

from __future__ import annotations

import logging
import os
import sys
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from attnlab.cli.app import command_line
from attnlab.errors import EXIT_INTERNAL, AttnlabError, ResourceError, UsageError
from attnlab.limits import MAX_PROCESSES

if TYPE_CHECKING:
    from attnlab.training.distributed import DistInfo

__all__ = [
    "Nodes",
    "launched",
    "launch",
    "quiet_error",
    "corpus_processes",
    "process_group",
    "nproc_option",
    "resume_option",
    "nnodes_option",
    "node_rank_option",
    "master_addr_option",
    "master_port_option",
]

EXIT_INTERRUPTED = 130
"""A process stopped by a signal (Ctrl-C): the shell's code for SIGINT."""

DEFAULT_MASTER_PORT = 29500
"""torchrun's default port of the first machine's rendezvous."""


@dataclass(frozen=True)
class Nodes:
    """The machines a corpus run spans (see the module docstring): ``count`` of them, this one
    ``rank``, the first one reached at ``master_addr``:``master_port``. One machine by default.

    Raises:
        UsageError: a rank outside [0, count), several machines without ``--master-addr``, or
            ``--node-rank`` / ``--master-addr`` on one machine.
    """

    count: int = 1
    rank: int = 0
    master_addr: str | None = None
    master_port: int = DEFAULT_MASTER_PORT

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.count:
            raise UsageError(f"--node-rank: must lie in [0, --nnodes={self.count}), got {self.rank}")
        if self.count > 1 and not self.master_addr:
            raise UsageError(f"--master-addr: needed with --nnodes {self.count} (the address of node 0)")
        if self.count == 1 and self.master_addr:
            raise UsageError("--master-addr: only with --nnodes > 1 (one machine finds its own port)")

    @property
    def several(self) -> bool:
        return self.count > 1


def launched() -> bool:
    """Whether this process is one of several that a launcher started (WORLD_SIZE > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def quiet_error(error: BaseException) -> bool:
    """Whether a launched process other than the first stays silent about ``error``: an error of
    the input, which every process meets alike and the first reports (not a lack of resources,
    which may strike one process alone)."""
    return (
        launched()
        and os.environ.get("RANK", "0") != "0"
        and isinstance(error, AttnlabError)
        and not isinstance(error, ResourceError)
    )


def launch(nproc: int, args: Sequence[str], nodes: Nodes = Nodes()) -> None:
    """Run ``python -m attnlab ARGS`` on ``nproc`` local processes and wait for them; with several
    ``nodes``, as node ``nodes.rank`` of them (every node's processes in one process group).

    Each process runs with OMP_NUM_THREADS=1 unless it is set (N processes share the cores).

    Raises:
        typer.Exit: a process failed; its exit code (the first process's that failed).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException  # torch: imported when used
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    rendezvous: dict[str, Any] = {
        "run_id": str(uuid.uuid4()),
        "rdzv_backend": "c10d",
        "rdzv_endpoint": "localhost:0",  # --standalone: a free port on this machine
    }
    if nodes.several:  # torchrun's static rendezvous: node ranks as given, node 0 hosting the store
        rendezvous = {
            "run_id": "attnlab",
            "rdzv_backend": "static",
            "rdzv_endpoint": f"{nodes.master_addr}:{nodes.master_port}",
            "rdzv_configs": {"rank": nodes.rank},
        }
    config = LaunchConfig(
        min_nodes=nodes.count, max_nodes=nodes.count, nproc_per_node=nproc, max_restarts=0, **rendezvous
    )
    logger = logging.getLogger("torch.distributed.elastic")
    level, threads = logger.level, os.environ.get("OMP_NUM_THREADS")
    logger.setLevel(logging.CRITICAL)  # the processes print their own errors
    os.environ["OMP_NUM_THREADS"] = threads or "1"
    try:
        elastic_launch(config, sys.executable)("-m", "attnlab", *args)
    except ChildFailedError as error:
        _, failure = error.get_first_failure()
        raise typer.Exit(failure.exitcode if failure.exitcode > 0 else EXIT_INTERRUPTED) from None
    except SignalException:
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except Exception as error:  # noqa: BLE001 - the launcher itself failed (no free port, ...)
        typer.echo(f"error: could not start {nproc} processes: {error}", err=True)
        raise typer.Exit(EXIT_INTERNAL) from None
    finally:
        logger.setLevel(level)
        if threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = threads


def corpus_processes(
    ctx: typer.Context, nproc: int, resume: bool, texts: Path | None, device: str, nodes: Nodes = Nodes()
) -> tuple[DistInfo, str] | None:
    """Where this corpus run (``--texts``, :mod:`attnlab.analysis.corpus`) runs.

    In the command a person ran: the file is read once first (:func:`attnlab.analysis.corpus.check_corpus`:
    an empty file, a line that is not UTF-8, is refused before any model work), then with
    ``nproc`` > 1 (or several ``nodes``) the command runs again on ``nproc`` processes of this
    machine (:func:`launch`), joined by the other machines' where there are several, and is done here.
    In each of those processes (and with one process): this process's place and its device (a GPU
    of its own, ``cuda:LOCAL_RANK``).

    Returns:
        None when the processes launched from here have done the work; else (place, device).

    Raises:
        UsageError: ``--nproc`` or ``--resume`` without ``--texts``; more processes than cores or GPUs.
    """
    from attnlab.training.distributed import DistInfo, from_environment  # torch: imported when used

    if texts is None:
        if nproc > 1 or resume or nodes.several:
            flag = "--nproc" if nproc > 1 else "--resume" if resume else "--nnodes"
            raise UsageError(f"{flag}: only for a corpus run; give --texts FILE")
        return DistInfo(), device
    if launched():
        info = from_environment(device)
        return info, f"cuda:{info.local_rank}" if device.startswith("cuda") else device
    from attnlab.analysis.corpus import check_corpus
    from attnlab.devices import check_processes

    check_corpus(texts)
    if nproc <= 1 and not nodes.several:
        return DistInfo(), device
    try:
        check_processes(device, nproc)
    except ValueError as exc:
        raise UsageError(f"--nproc {nproc}: {exc}") from None
    launch(nproc, command_line(ctx), nodes)
    return None


@contextmanager
def process_group(info: DistInfo) -> Iterator[None]:
    """Leave the process group at the end of the block: after every process has come this far when
    it ends well, at once when it raises (see :func:`attnlab.training.distributed.shutdown`)."""
    from attnlab.training.distributed import shutdown

    try:
        yield
    except BaseException:
        shutdown(info)
        raise
    shutdown(info, wait_for_peers=True)


def nproc_option() -> Any:
    """The ``--nproc`` option of the corpus runs."""
    return typer.Option(
        1,
        "--nproc",
        min=1,
        max=MAX_PROCESSES,
        help="Spread the --texts corpus over N processes (torchrun: gloo on the CPU, NCCL on GPUs, one GPU "
        "each); their sums are added in float64, so N processes give the one-process result.",
    )


def nnodes_option() -> Any:
    """The ``--nnodes`` option of the corpus runs."""
    return typer.Option(
        1,
        "--nnodes",
        min=1,
        max=MAX_PROCESSES,
        help="Spread the --texts corpus over this many machines, each running this command with its "
        "--node-rank and the same --master-addr (torchrun's static rendezvous; a shared file system).",
    )


def node_rank_option() -> Any:
    """The ``--node-rank`` option of the corpus runs."""
    return typer.Option(
        0, "--node-rank", min=0, max=MAX_PROCESSES - 1, help="This machine's rank among --nnodes, 0 to M - 1."
    )


def master_addr_option() -> Any:
    """The ``--master-addr`` option of the corpus runs."""
    return typer.Option(None, "--master-addr", help="The address of machine 0 (node rank 0), with --nnodes > 1.")


def master_port_option() -> Any:
    """The ``--master-port`` option of the corpus runs."""
    return typer.Option(
        DEFAULT_MASTER_PORT, "--master-port", min=1, max=65535, help="Machine 0's rendezvous port, with --nnodes > 1."
    )


def resume_option() -> Any:
    """The ``--resume`` flag of the corpus runs."""
    return typer.Option(
        False,
        "--resume",
        help="Continue an interrupted --texts run from its last saved state (written beside the output "
        "after every few batches), losing nothing; the same run, file and options, any --nproc.",
    )
