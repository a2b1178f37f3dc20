"""Sweeps: one config trained over a grid of keys and seeds, then results over seeds.

A single run misleads (Dyck-1 with sinusoidal positions scored 0.81 on the length-generalisation
split with seed 0 and 0.42 with seed 2); the papers that test what self-attention can recognise
(Bhattamishra et al. 2020; Delétang et al. 2023; Ruoss et al. 2023) report tables over seeds. A
sweep is the product of its grids and its seeds::

    attnlab sweep configs/dyck1.toml --grid model.positional=sinusoidal,learned,none \\
        --grid model.attention=soft,hard --seeds 0-4 --out sweeps/dyck1 --jobs 2

Every run's config is ``CONFIG.toml``, then the sweep's defaults (``train.threads = 1``,
``train.final_splits = ["test", "length_generalisation"]``), then
``--set`` (as ``attnlab train --set``), then its grid values, then its seed: a seed sets
``train.seed`` and, where the task has one, ``task.seed``. All of them are built and checked, as
``attnlab train`` checks one (keys, values, the task, the model config, the memory estimate),
before anything is written.

A config file may carry its own grid and seeds in a ``[sweep]`` table (what
``configs/papers/`` do), so that ``attnlab sweep FILE --out DIR`` alone reproduces a table::

    [sweep]
    seeds = "0-2"
    [sweep.grid]
    "model.positional" = ["none", "sinusoidal", "learned"]
    "task.name" = ["dyck1", "parity"]

``--grid KEY=...`` on the command line replaces that key's values (or adds a key), ``--seeds``
replaces the seeds. ``attnlab train FILE`` ignores the table and trains the file's base config.

The sweep folder ``DIR`` holds:

* ``sweep.json``: the config file's tables, ``--set``, the grid, the seeds and each run's resolved
  config. Running the sweep again with the same ``--out`` resumes it; a different grid, seed list,
  ``--set`` or config is refused.
* ``runs/NAME/``: one ordinary run directory per run (``attnlab eval DIR/runs/NAME`` works), named
  from its grid keys in full, their values and the seed, e.g.
  ``model.positional-learned_model.attention-hard_seed-3`` (a sweep recorded with the
  earlier short names, ``positional-learned_...``, keeps them: they are read from ``sweep.json``).
* ``outcomes/NAME.json``: how the run ended: ``ok``, ``failed`` or ``diverged`` with its error line,
  its steps and the wall time of the session that finished it. A run with an outcome is not run
  again (``retry_failed`` re-runs the failed ones); a run folder without one was interrupted: it
  resumes from its last checkpoint through the trainer's resume, or starts over if it has none.
* ``results.csv`` (one row per run: grid values, seed, status, error, steps, final training loss,
  wall time, and every number the end-of-training evaluation wrote per split: ``valid.accuracy``,
  ``length_13_24.accuracy``, ``length_13_24.horizon``, ``length_bins.horizon``, ...; and read from
  them, each split's ``lengths`` and a held-out split's ``passes`` and ``first_failing_length``),
  ``accuracy_by_length.csv`` (run, split, length, accuracy, strings, binomial standard error),
  ``summary.md`` (per combination and split: mean ± sample std, min–max over seeds, runs finished
  and failed, the binomial standard error of one run's figure, the seeds reaching the threshold;
  each split named with its lengths; then the generalisation horizon's mean ± std and min–max, and
  each held-out split's passing seeds and first failing lengths), ``plots/accuracy_by_length-SPLIT.png``
  and ``plots/accuracy_by_length_per_seed-COMBINATION.png`` (one line per seed), all rebuilt from the runs by
  :func:`~attnlab.sweep.report.write_report` from what each run's ``metrics.jsonl`` holds, never recomputed.

With ``jobs = 1`` the runs train one after another in this process; with ``jobs = N > 1`` in N
worker processes (spawned; each trains one run at a time on its ``train.threads``, imports PyTorch
once and trains many runs). Either way a run that fails is recorded and the others go on, and a
run's numbers do not depend on ``jobs``: every run seeds itself from its config.

The package, one module per stage:

* :mod:`.plan`: the grid, the seeds and every run's config, each checked by the trainer's own
  checks (:func:`~attnlab.sweep.plan.plan_sweep`).
* :mod:`.execute`: the runs trained and their outcomes recorded (:func:`~attnlab.sweep.execute.run_sweep`).
* :mod:`.report`: the tables, summary and plots rebuilt from the runs (:func:`~attnlab.sweep.report.write_report`).
* :mod:`.folder`: where a sweep's files lie.

The package's own names (:data:`__all__`) load their module on first use (:mod:`attnlab.lazy`).
"""

from attnlab.lazy import lazy_exports

_HOMES = {
    "plan_sweep": "attnlab.sweep.plan",
    "run_sweep": "attnlab.sweep.execute",
    "write_report": "attnlab.sweep.report",
}

__all__ = list(_HOMES)

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
