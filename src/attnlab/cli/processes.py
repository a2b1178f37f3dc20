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

Workers die with their launcher: each runs ``python -m attnlab.cli.worker`` (the command after
:func:`attnlab.lifeline.follow_launcher`), so a kill -9 of the ``attnlab`` command ends its
workers too (Linux's parent-death signal, SIGKILL) before any writes a result or removes a resume
state; ``--resume`` continues from the last state saved. A worker that dies of a signal (kill -9,
the OOM killer, a crash) ends the command with one line naming it, ``error: worker 1 (rank 1)
died of SIGKILL; ...``, and exit code 1 (:data:`EXIT_WORKER_DIED`); the launcher stops the other
workers. Ctrl-C (SIGINT) or SIGTERM of the command stops them all and exits 130, "interrupted".
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from attnlab.cli.app import command_line
from attnlab.errors import EXIT_INTERNAL, AttnlabError, ResourceError, UsageError
from attnlab.lifeline import LAUNCHER_ENV, follow_launcher
from attnlab.limits import MAX_PROCESSES

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

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
"""The command stopped by Ctrl-C or SIGTERM: the shell's code for SIGINT."""

EXIT_WORKER_DIED = EXIT_INTERNAL
"""A worker process that died of a signal (not one of the input's errors, which the worker
reports with their own code)."""

WORKER_ENTRY = "attnlab.cli.worker"
"""The module each worker runs (``python -m``): the command, after following its launcher."""

PEER_GRACE_SECONDS = 3.0
"""How long a launched process whose collective failed waits for its launcher to stop it (a peer
died), before it reports the failure itself (:func:`process_group`)."""

CORPUS_HINT = "the saved state is kept: rerun with --resume to continue"
"""What a corpus run's line about a dead worker suggests."""

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


def launch(nproc: int, args: Sequence[str], nodes: Nodes = Nodes(), *, hint: str = "") -> None:
    """Run ``attnlab ARGS`` on ``nproc`` local processes (``python -m attnlab.cli.worker ARGS``)
    and wait for them; with several ``nodes``, as node ``nodes.rank`` of them (every node's
    processes in one process group).

    Each process runs with OMP_NUM_THREADS=1 unless it is set (N processes share the cores), and
    dies with this one (:mod:`attnlab.lifeline`).

    Args:
        hint: what the line about a worker that died of a signal suggests after it.

    Raises:
        typer.Exit: a process failed: the exit code of the first that exited with one (it printed
            its own line), :data:`EXIT_WORKER_DIED` after one ``error:`` line when it died of a
            signal, 130 when this command was interrupted.
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
    levels = _quiet_launcher_logs()  # the processes print their own errors
    saved = {name: os.environ.get(name) for name in ("OMP_NUM_THREADS", LAUNCHER_ENV)}
    os.environ["OMP_NUM_THREADS"] = saved["OMP_NUM_THREADS"] or "1"
    os.environ[LAUNCHER_ENV] = str(os.getpid())  # the workers follow this process
    try:
        elastic_launch(config, sys.executable)("-m", WORKER_ENTRY, *args)
    except ChildFailedError as error:
        rank, failure = _first_failure(error.failures)
        if failure.exitcode > 0:
            raise typer.Exit(failure.exitcode) from None
        typer.echo(f"error: {_died(rank, failure, hint)}", err=True)
        raise typer.Exit(EXIT_WORKER_DIED) from None
    except SignalException:
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except Exception as error:  # noqa: BLE001 - the launcher itself failed (no free port, ...)
        typer.echo(f"error: could not start {nproc} processes: {error}", err=True)
        raise typer.Exit(EXIT_INTERNAL) from None
    finally:
        for logger, level in levels.items():
            logger.setLevel(level)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _quiet_launcher_logs() -> dict[logging.Logger, int]:
    """Silence the launcher's loggers (each module of torch.distributed.elastic sets a level of its
    own: "Received 2 death signal, shutting down workers"); their levels before, to restore."""
    names = [name for name in logging.root.manager.loggerDict if name.startswith("torch.distributed.elastic")]
    levels = {}
    for logger in map(logging.getLogger, ["torch.distributed.elastic", *names]):
        levels[logger] = logger.level
        logger.setLevel(logging.CRITICAL)
    return levels


def _first_failure(failures: dict[int, ProcessFailure]) -> tuple[int, ProcessFailure]:
    """The failure that ended the run, with its global rank: the first to die of a signal other
    than SIGTERM (a kill, a crash; its peers may fail after it, their connections cut), else the
    first to exit with a code (an error it printed), else the first stopped by SIGTERM (the
    launcher sends that to the workers left once one failed). ``failures`` is in the order the
    launcher found them."""

    def order(item: tuple[int, ProcessFailure]) -> int:
        code = item[1].exitcode
        return 0 if code < 0 and -code != signal.SIGTERM else 1 if code > 0 else 2

    return min(failures.items(), key=order)


def _died(rank: int, failure: ProcessFailure, hint: str) -> str:
    """``worker 1 (rank 1) died of SIGKILL; HINT``: a worker (its local rank) that a signal ended."""
    try:
        name = signal.Signals(-failure.exitcode).name
    except ValueError:
        name = f"signal {-failure.exitcode}"
    return f"worker {failure.local_rank} (rank {rank}) died of {name}" + (f"; {hint}" if hint else "")


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
        follow_launcher()  # already done by attnlab.cli.worker; a torchrun of one's own too
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
    launch(nproc, command_line(ctx), nodes, hint=CORPUS_HINT)
    return None


@contextmanager
def process_group(info: DistInfo) -> Iterator[None]:
    """Leave the process group at the end of the block: after every process has come this far when
    it ends well, at once when it raises (see :func:`attnlab.training.distributed.shutdown`).

    A launched process whose block fails with an error that is not attnlab's (a collective cut
    short: "Connection closed by peer") first waits :data:`PEER_GRACE_SECONDS`: when a peer died,
    the launcher stops this process meanwhile, and the command's one line names the dead worker,
    not the error its death caused here. Otherwise (a peer on another machine, a bug) the error
    is reported as it would be."""
    from attnlab.training.distributed import shutdown

    try:
        yield
    except BaseException as error:
        if launched() and _not_attnlabs(error):
            time.sleep(PEER_GRACE_SECONDS)
        shutdown(info)
        raise
    shutdown(info, wait_for_peers=True)


def _not_attnlabs(error: BaseException) -> bool:
    """Whether ``error`` is an exception attnlab did not raise itself (nor an exit or Ctrl-C)."""
    return isinstance(error, Exception) and not isinstance(error, (AttnlabError, typer.Exit, typer.Abort))


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
