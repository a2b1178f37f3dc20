"""A run directory and everything that reads or writes one.

* :mod:`.storage`: atomic writes (temporary file, fsync, rename) and safetensors I/O whose errors
  name the file.
* :mod:`.manifest`: the size and SHA-256 of every file a command reads.
* :mod:`.metrics_log`: metrics.jsonl and the record each checkpoint keeps of it.
* :mod:`.lock`: one writer per run directory (an OS file lock on ``RUN/.lock``).
* :mod:`.weights`: a model's weights as a safetensors file's tensors (tied ones stored once), and back.
* :mod:`.layout`: the names of a run's files and folders.
* :mod:`.reading`: a run's files read, each verified against its manifest; a checkpoint chosen.
* :mod:`.writing`: a run's files written atomically and recorded; checkpoints committed and pruned.
* :mod:`.directory`: :class:`~attnlab.run.directory.RunDir` (layout, reading and writing together),
  the one place that reads and writes a run's files (config, tokenizer, weights, checkpoints, metrics).
* :mod:`.output_paths`: every output path checked before any work starts.
* :mod:`.verification`: ``attnlab verify``: every file checked against its manifest.
* :mod:`.loaded`: :func:`~attnlab.run.loaded.open_run`, a trained run ready to use (its config,
  task, tokenizer and model).

The package's own names (:data:`__all__`) load their module on first use (:mod:`attnlab.lazy`):
``from attnlab.run import open_run`` works, and ``from attnlab.run.storage import atomic_write``
loads none of the task and model code that :mod:`.loaded` needs.
"""

from attnlab.lazy import lazy_exports

_HOMES = {
    "open_run": "attnlab.run.loaded",
    "LoadedRun": "attnlab.run.loaded",
    "RunDir": "attnlab.run.directory",
    "verify_run": "attnlab.run.verification",
}

__all__ = list(_HOMES)

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
