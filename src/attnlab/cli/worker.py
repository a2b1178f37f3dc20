"""``python -m attnlab.cli.worker ARGS``: one of the N processes of ``attnlab ARGS --nproc N``.

What :func:`attnlab.cli.processes.launch` starts on each process, in place of ``python -m
attnlab``: the same command, run by :func:`attnlab.cli.main`, after the process has tied its life
to the launcher's (:func:`attnlab.lifeline.follow_launcher`): a launcher killed outright takes its
workers with it, and none of them writes a result or removes a resume state after it.

Ctrl-C reaches the launcher alone (each worker has a session of its own), which passes SIGINT on
to stop the workers: a worker then ends at once without a word (the signal's default action,
where Python would raise KeyboardInterrupt and print "interrupted" once per process); the
command prints "interrupted" once.
"""

from __future__ import annotations

import signal

from attnlab.lifeline import follow_launcher


def run() -> None:
    """Follow the launcher, then run the command line of this process (``sys.argv[1:]``)."""
    follow_launcher()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    from attnlab.cli import main

    main()


if __name__ == "__main__":
    run()
