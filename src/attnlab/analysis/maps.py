"""Run a loaded model on one input and capture every attention map, with token labels.

The output is what the plots and the viewer show: for each :class:`attnlab.nn.AttentionRecord`,
the tokens along its query and key axes. For an encoder-decoder the input is decoded greedily
first, then one teacher-forced pass over (source, BOS + output) records all three kinds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from attnlab.decoding import DecodeOptions, decode, generate_continuations
from attnlab.experiment import LoadedRun
from attnlab.nn import AttentionRecord, capture

__all__ = ["AttentionView", "attention_view"]


@dataclass(frozen=True)
class AttentionView:
    """Every attention map of one forward pass.

    Attributes:
        records: one per attention module call (kind, layer, weights (1, H, T_q, T_k), ...).
        axes: kind -> (query tokens, key tokens).
        output: the decoded sequence, the class, or the continuation, as text.
        probability: the class probability (classifiers), else None.
    """

    records: list[AttentionRecord]
    axes: dict[str, tuple[list[str], list[str]]]
    output: str
    probability: float | None = None


@torch.no_grad()
def attention_view(
    loaded: LoadedRun, text: str, *, head_mask: Mapping[str, Tensor] | None = None, max_length: int = 64
) -> AttentionView:
    """Run ``loaded.model`` on ``text`` (optionally with heads masked) and capture its attention."""
    task, codec, model = loaded.task, loaded.codec, loaded.model
    ids = codec.encode(text)
    kind = loaded.experiment.model_kind
    if kind == "encoder_decoder":
        src = torch.tensor([ids + [task.eos_id]])
        hypothesis = decode(model, src, bos_id=task.bos_id, eos_id=task.eos_id, pad_id=task.pad_id,
                            options=DecodeOptions(max_length=max_length), head_mask=head_mask)[0]
        tgt_in = torch.tensor([[task.bos_id, *hypothesis.tokens]])
        with capture(model) as records:
            model(src, tgt_in, head_mask=head_mask)
        source = codec.tokens(ids) + ["</s>"]
        target = ["<s>"] + codec.tokens(hypothesis.tokens)
        axes = {"encoder_self": (source, source), "decoder_self": (target, target), "cross": (target, source)}
        return AttentionView(records, axes, codec.decode(hypothesis.tokens))
    if kind == "encoder_classifier":
        tokens = torch.tensor([ids + [task.eos_id]])
        with capture(model) as records:
            probs = torch.softmax(model(tokens, head_mask=head_mask), -1)[0]
        labels = codec.tokens(ids) + ["</s>"]
        label = int(probs.argmax())
        return AttentionView(records, {"self": (labels, labels)}, str(label), float(probs[label]))
    prompt = [task.bos_id, *ids]
    hypothesis = generate_continuations(model, [prompt], eos_id=task.eos_id, banned=(task.pad_id, task.bos_id),
                                        options=DecodeOptions(max_length=max_length), head_mask=head_mask)[0]
    full = torch.tensor([prompt + hypothesis.tokens])
    with capture(model) as records:
        model(full, head_mask=head_mask)
    labels = ["<s>"] + codec.tokens(ids + hypothesis.tokens)
    return AttentionView(records, {"self": (labels, labels)}, codec.decode(hypothesis.tokens))
