"""``attnlab generate``: decode, translate, classify or continue text with a trained run."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from attnlab.cli.app import app
from attnlab.cli.options import (
    SOURCE_HELP,
    attention_option,
    device_map_option,
    device_option,
    dtype_option,
    max_memory_option,
    offload_folder_option,
    placed,
    revision_option,
    verify_option,
)
from attnlab.errors import UsageError
from attnlab.limits import MAX_BEAM, MAX_LENGTH_PENALTY, MAX_NEW_TOKENS, MAX_SEED, MAX_TEMPERATURE, MAX_VOCAB_SIZE
from attnlab.resources import check_input_text


@app.command()
def generate(
    run: Path = typer.Argument(..., help=SOURCE_HELP),
    texts: list[str] = typer.Argument(..., help="Inputs: symbols of the task (e.g. abcd) or text."),
    beam: int = typer.Option(1, "--beam", min=1, max=MAX_BEAM, help=f"Beam size (1 = greedy; at most {MAX_BEAM})."),
    max_new_tokens: int = typer.Option(
        64,
        "--max-new-tokens",
        "--max-length",
        min=1,
        max=MAX_NEW_TOKENS,
        help=f"Most new tokens, EOS included (at most {MAX_NEW_TOKENS}); --max-length is the older name.",
    ),
    length_penalty: float = typer.Option(
        1.0, "--length-penalty", min=0.0, max=MAX_LENGTH_PENALTY, help="Beam search: divide scores by length**P."
    ),
    temperature: float = typer.Option(
        0.0,
        "--temperature",
        min=0.0,
        max=MAX_TEMPERATURE,
        help="Sample at this temperature (> 0); 0 means greedy decoding (the default), not a division by zero.",
    ),
    top_k: int | None = typer.Option(
        None, "--top-k", min=1, max=MAX_VOCAB_SIZE, help="Sample from the K most probable tokens only (K >= 1)."
    ),
    top_p: float | None = typer.Option(
        None,
        "--top-p",
        min=0.0,
        max=1.0,
        help="Sample from the smallest set of tokens whose probability reaches P (0 < P <= 1).",
    ),
    seed: int | None = typer.Option(
        None, "--seed", min=0, max=MAX_SEED, help="Seed of the draws: the same seed gives the same text."
    ),
    chat: bool = typer.Option(False, "--chat", help="Put each TEXT in the model's chat template (pretrained LMs)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per input, when it is done."),
    device: str = device_option(),
    device_map: str | None = device_map_option(),
    max_memory: str | None = max_memory_option(),
    offload_folder: Path | None = offload_folder_option(),
    dtype: str | None = dtype_option(),
    revision: str | None = revision_option(),
    verify: bool = verify_option(),
    attention: str | None = attention_option(),
) -> None:
    """Run a model on each TEXT: the output sequence, the class with its probability, or a continuation.

    A language model's continuation is printed as it is produced, after TEXT and a tab (--json: one object at the end).

    Greedy unless --temperature > 0, which samples (with --top-k, --top-p, --seed; the same seed gives the same text).

    Heads held at zero in training (train.mask_heads) stay off, as in `attnlab eval`.
    """
    # Imported when the command runs: the help pages load no torch (see attnlab.cli).
    from attnlab.generate.search import DecodeOptions
    from attnlab.pretrained.sources import open_model

    sampling = _sampling(temperature, top_k, top_p, seed, beam=beam)
    for number, text in enumerate(texts, start=1):
        check_input_text(text, what=_which(number, len(texts)))
    loaded = open_model(
        run,
        dtype=dtype,
        revision=revision,
        verify=verify,
        attention=attention,
        **placed(device, device_map, max_memory, offload_folder, tokens=_positions(texts, max_new_tokens, beam)),
    )
    model = loaded.experiment.model_config_class
    if model.embeds_sentences:
        raise UsageError(f"{run} is a sentence encoder: it generates nothing; use `attnlab encode RUN TEXT...`")
    if chat and not model.language_model:
        raise UsageError(f"--chat: {run} is not a language model ({model.kind}); only language-model runs chat")
    encoded, new_tokens = [], []
    for number, text in enumerate(texts, start=1):  # every input checked before the first is decoded
        ids, new = _prepared(loaded, text, max_new_tokens, chat=chat, what=_which(number, len(texts)))
        encoded.append(ids)
        new_tokens.append(new)
    for text, ids, new in zip(texts, encoded, new_tokens, strict=True):
        options = DecodeOptions(max_length=new, beam_size=beam, length_penalty=length_penalty, sampling=sampling)
        result = _RUNNERS[model.kind](loaded, text, ids, options, stream=not as_json and beam == 1)
        if as_json:
            typer.echo(json.dumps(result))
        elif "label" in result and loaded.task.kind != "recognition":  # a class, not membership
            typer.echo(f"{text}\tclass {result['label']} (p={result['probability']:.3f})")
        elif "label" in result:
            verdict = "in the language" if result["label"] == 1 else "not in the language"
            typer.echo(f"{text}\t{result['label']} ({verdict}, p={result['probability']:.3f})")
        elif "output" in result:
            typer.echo(f"{text}\t{result['output']}")
        elif beam > 1:  # a beam's continuation is known only at the end
            typer.echo(f"{text}\t{result['continuation']}")


def _positions(texts: list[str], max_new_tokens: int, beam: int) -> int:
    """At most how many positions a KV cache holds (a text has no more tokens than characters, and
    a chat template's own): what a placement holds back before its layers are placed."""
    return beam * (max(map(len, texts)) + 256 + max_new_tokens)


def _sampling(temperature: float, top_k: int | None, top_p: float | None, seed: int | None, *, beam: int):
    """The sampling options the flags ask for (None: greedy or beam search), or one UsageError."""
    from attnlab.generate.sampling import SamplingOptions

    # The options' ranges are checked when the command line is parsed; P = 0 would keep no token.
    if top_p == 0:
        raise UsageError("--top-p: must lie in (0, 1], got 0")
    if temperature == 0:
        if top_k is not None or top_p is not None:
            flag = "--top-k" if top_k is not None else "--top-p"
            raise UsageError(f"{flag}: only when sampling; add --temperature T (> 0; 0, the default, is greedy)")
        return None
    if beam > 1:
        raise UsageError("--beam: beam search does not sample; use --beam 1 with --temperature, or --temperature 0")
    return SamplingOptions(temperature=temperature, top_k=top_k or 0, top_p=1.0 if top_p is None else top_p, seed=seed)


def _prepared(loaded, text: str, max_new: int, *, chat: bool, what: str) -> tuple[list[int], int]:  # noqa: ANN001
    """:func:`attnlab.analysis.maps.generation_ids`: the ids and the new tokens allowed, or one UsageError."""
    from attnlab.analysis.maps import generation_ids

    return generation_ids(loaded, text, max_new, chat=chat, what=what)


def _translate(loaded, text: str, ids: list[int], options, *, stream: bool) -> dict:  # noqa: ANN001
    from attnlab.analysis.maps import decode_source

    hypothesis = decode_source(loaded, ids, options, loaded.held_mask())
    return {"input": text, "output": loaded.codec.decode(hypothesis.tokens), "log_prob": hypothesis.log_prob}


def _classify(loaded, text: str, ids: list[int], options, *, stream: bool) -> dict:  # noqa: ANN001
    import torch

    from attnlab.devices import model_device
    from attnlab.nn import masking_heads

    model = loaded.model
    with torch.no_grad(), masking_heads(model, loaded.held_mask()):
        source = torch.tensor([ids + [loaded.task.eos_id]], device=model_device(model))
        probs = torch.softmax(model(source), -1)[0]
    label = int(probs.argmax())
    return {"input": text, "label": label, "probability": float(probs[label])}


def _continue(loaded, text: str, prompt: list[int], options, *, stream: bool) -> dict:  # noqa: ANN001
    """Continue ``prompt``; with ``stream``, print ``text``, a tab, then the continuation as it grows."""
    from attnlab.generate.search import generate_continuations
    from attnlab.generate.stream import TextStream

    task = loaded.task
    pieces = TextStream(loaded.codec.decode)
    ended = False

    def show(token) -> None:  # noqa: ANN001
        nonlocal ended
        if ended or int(token[0]) == task.eos_id:
            ended = True
            return
        typer.echo(pieces.push([int(token[0])]), nl=False)

    if stream:
        typer.echo(f"{text}\t", nl=False)
    hypothesis = generate_continuations(
        loaded.model,
        [prompt],
        eos_id=task.eos_id,
        banned=task.generation_banned,
        options=options,
        head_mask=loaded.held_mask(),
        on_token=show if stream else None,
    )[0]
    if stream:
        typer.echo(pieces.finish())
    return {
        "input": text,
        "continuation": loaded.codec.decode(hypothesis.tokens),
        "log_prob": hypothesis.log_prob,
        "tokens": len(hypothesis.tokens),
        "ended": hypothesis.finished,
    }


_RUNNERS = {"encoder_decoder": _translate, "encoder_classifier": _classify, "decoder_only": _continue}
"""Model kind -> how one prepared input is run (it returns the JSON object of the result)."""


def _which(number: int, count: int) -> str:
    """How an input is named in an error: TEXT, or TEXT 3 (of several)."""
    return "TEXT" if count == 1 else f"TEXT {number}"
