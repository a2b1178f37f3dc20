"""Tasks: seeded generators and file readers that turn inputs into examples, and batching.

* :mod:`.formal`: language recognition, label read at EOS (Hahn §3): parity, dyck1, dyck2, anbn,
  anbncn; the languages by family in :mod:`.formal_parity`, :mod:`.formal_dyck`,
  :mod:`.formal_counter` (:mod:`.formal_base`: what a language is), split baselines in
  :mod:`.formal_splits`.
* :mod:`.seq2seq`: copy, reverse, sort, addition.
* :mod:`.chomsky`: the tasks of Delétang et al. 2023 (Neural Networks and the Chomsky Hierarchy):
  even_pairs, cycle_navigation, modular_arithmetic (classification); reverse_string,
  stack_manipulation, duplicate_string, binary_addition, binary_multiplication (sequences).
* :mod:`.text`: translation from parallel TSV, lm from plain text; file+line errors.
* :mod:`.sentences`: texts for a sentence encoder, framed as BERT reads them.
* :mod:`.batching`: pad + mask, bucket by length, deterministic shuffle, max-length policy.
* :mod:`.registry`: ``TASKS``, one entry per task name (how to build it, its kind, the model kind it
  trains, whether it reads text); ``get_task(name, **options)``; ``build_task`` (a [task] section ->
  task and tokenizer).
* :mod:`.codec`: ``TextCodec``, text <-> token ids.

Every task gives ``train()``, ``valid()``, ``test()`` and ``length_generalisation()`` (lengths
1..L vs L+1..2L), and never puts one string in two splits.
"""

from attnlab.tasks.base import SPLITS, Example, Task, Vocab, split_of
from attnlab.tasks.batching import Batch, collate, fit_length, make_batches
from attnlab.tasks.chomsky import CHOMSKY_TASKS
from attnlab.tasks.formal import LANGUAGES, RecognitionTask
from attnlab.tasks.formal_base import near_misses
from attnlab.tasks.registry import TASKS, get_task, task_options
from attnlab.tasks.sentences import SentencesTask
from attnlab.tasks.seq2seq import TRANSFORMS, AdditionTask, Seq2SeqTask
from attnlab.tasks.text import BadLine, Lines, LMTask, TranslationTask, read_lines, read_parallel

__all__ = [
    "SPLITS",
    "CHOMSKY_TASKS",
    "LANGUAGES",
    "TASKS",
    "TRANSFORMS",
    "AdditionTask",
    "BadLine",
    "Batch",
    "Example",
    "Lines",
    "LMTask",
    "RecognitionTask",
    "Seq2SeqTask",
    "SentencesTask",
    "Task",
    "TranslationTask",
    "Vocab",
    "collate",
    "fit_length",
    "get_task",
    "make_batches",
    "near_misses",
    "read_lines",
    "read_parallel",
    "split_of",
    "task_options",
]
