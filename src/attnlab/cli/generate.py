"""``attnlab generate``: decode, translate, classify or continue text with a trained run."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from attnlab.cli.app import app
from attnlab.cli.options import device_option
from attnlab.resources import (
    MAX_BEAM,
    MAX_NEW_TOKENS,
    check_beam,
    check_decode_length,
    check_input_text,
    check_input_tokens,
    check_new_tokens,
)


@app.command()
def generate(
    run: Path = typer.Argument(..., help="A run directory written by `attnlab train`."),
    texts: list[str] = typer.Argument(..., help="Inputs: symbols of the task (e.g. abcd) or text."),
    beam: int = typer.Option(1, "--beam", min=1, help=f"Beam size (1 = greedy; at most {MAX_BEAM})."),
    max_length: int = typer.Option(64, "--max-length", min=1, help=f"Most new tokens (at most {MAX_NEW_TOKENS})."),
    length_penalty: float = typer.Option(1.0, "--length-penalty", min=0.0),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per input."),
    device: str = device_option(),
) -> None:
    """Run a trained model on each TEXT: the output sequence, the class with its probability, or a continuation.

    Heads held at zero in training (train.mask_heads) stay off, as in `attnlab eval`.
    """
    import torch

    from attnlab.decoding import DecodeOptions, decode, generate_continuations
    from attnlab.devices import model_device
    from attnlab.loaded_run import open_run

    check_beam(beam, flag="--beam")
    check_new_tokens(max_length, flag="--max-length")
    for number, text in enumerate(texts, start=1):
        check_input_text(text, what=_which(number, len(texts)))
    loaded = open_run(run, device=device)
    if loaded.experiment.model_kind == "encoder":
        from attnlab.errors import UsageError

        raise UsageError(f"{run} is a sentence encoder: it generates nothing; use `attnlab encode RUN TEXT...`")
    task, codec, model = loaded.task, loaded.codec, loaded.model
    head_mask = loaded.held_mask()
    context = model.config.max_len
    encoded, new_tokens = [], []
    for number, text in enumerate(texts, start=1):  # every input checked before the first is decoded
        ids = codec.encode(text)
        check_input_tokens(len(ids) + 1, context=context, what=_which(number, len(texts)))  # + EOS or BOS
        prompt = 1 + (len(ids) if loaded.experiment.model_kind == "decoder_only" else 0)  # BOS (+ the prompt)
        decodes = loaded.experiment.model_kind != "encoder_classifier"
        new_tokens.append(check_decode_length(prompt, max_length, config=model.config) if decodes else max_length)
        encoded.append(ids)
    for text, ids, new in zip(texts, encoded, new_tokens, strict=True):
        options = DecodeOptions(max_length=new, beam_size=beam, length_penalty=length_penalty)
        kind = loaded.experiment.model_kind
        if kind == "encoder_decoder":
            hypothesis = decode(
                model,
                torch.tensor([ids + [task.eos_id]], device=model_device(model)),
                bos_id=task.bos_id,
                eos_id=task.eos_id,
                pad_id=task.pad_id,
                options=options,
                head_mask=head_mask,
            )[0]
            result = {"input": text, "output": codec.decode(hypothesis.tokens), "log_prob": hypothesis.log_prob}
        elif kind == "encoder_classifier":
            with torch.no_grad():
                probs = torch.softmax(
                    model(torch.tensor([ids + [task.eos_id]], device=model_device(model)), head_mask=head_mask), -1
                )[0]
            label = int(probs.argmax())
            result = {"input": text, "label": label, "probability": float(probs[label])}
        else:
            hypothesis = generate_continuations(
                model,
                [[task.bos_id, *ids]],
                eos_id=task.eos_id,
                banned=(task.pad_id, task.bos_id),
                options=options,
                head_mask=head_mask,
            )[0]
            result = {"input": text, "continuation": codec.decode(hypothesis.tokens), "log_prob": hypothesis.log_prob}
        if as_json:
            typer.echo(json.dumps(result))
        elif "label" in result:
            verdict = "in the language" if result["label"] == 1 else "not in the language"
            typer.echo(f"{text}\t{result['label']} ({verdict}, p={result['probability']:.3f})")
        else:
            typer.echo(f"{text}\t{result.get('output', result.get('continuation'))}")


def _which(number: int, count: int) -> str:
    """How an input is named in an error: TEXT, or TEXT 3 (of several)."""
    return "TEXT" if count == 1 else f"TEXT {number}"
