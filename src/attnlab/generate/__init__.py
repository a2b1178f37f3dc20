"""Generating tokens and text with a trained model.

* :mod:`.search`: greedy search, beam search and sampling over the KV cache, for
  :class:`~attnlab.nn.EncoderDecoder` (:func:`~attnlab.generate.search.decode`) and
  :class:`~attnlab.nn.DecoderOnly` (:func:`~attnlab.generate.search.generate_continuations`).
* :mod:`.sampling`: temperature, top-k and top-p, the distribution a sampled token is drawn from.
* :mod:`.chat`: a pretrained model's chat template rendered into a prompt.
* :mod:`.stream`: generated text handed out as it becomes final.

The package's own names (:data:`__all__`) load their module on first use (:mod:`attnlab.lazy`):
``from attnlab.generate import generate_continuations`` works, and a task that renders a chat
prompt (:mod:`.chat`) loads no model code.
"""

from attnlab.lazy import lazy_exports

_HOMES = {
    "DecodeOptions": "attnlab.generate.search",
    "SamplingOptions": "attnlab.generate.sampling",
    "decode": "attnlab.generate.search",
    "generate_continuations": "attnlab.generate.search",
}

__all__ = list(_HOMES)

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
