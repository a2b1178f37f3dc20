"""A run directory and everything that reads or writes one.

* :mod:`.storage`: atomic writes (temporary file, fsync, rename) and safetensors I/O whose errors
  name the file.
* :mod:`.manifest`: the size and SHA-256 of every file a command reads.
* :mod:`.lock`: one writer per run directory (an OS file lock on ``RUN/.lock``).
* :mod:`.directory`: :class:`~attnlab.run.directory.RunDir`, the one place that reads and writes
  a run's files (config, tokenizer, weights, checkpoints, metrics).
* :mod:`.output_paths`: every output path checked before any work starts.
* :mod:`.verification`: ``attnlab verify``: every file checked against its manifest.
* :mod:`.loaded`: :func:`~attnlab.run.loaded.open_run`, a trained run ready to use (its config,
  task, tokenizer and model).

The package imports none of them: ``from attnlab.run.storage import atomic_write`` loads neither
the task nor the model code that :mod:`.loaded` needs.
"""
