"""``attnlab.load``: one way in from Python, for any model attnlab opens, and the
:class:`LanguageModel` it returns, whose methods are every analysis of the command line.

:mod:`attnlab.lm.model` opens, tokenizes, runs, generates, traces and masks;
:mod:`attnlab.lm.studies` holds the analyses (patching, attribution, detection, ablation,
importance, the cache's helpers, the notebook views), each a method of the same object.
"""

from attnlab.lm.model import LanguageModel, load

__all__ = ["LanguageModel", "load"]
