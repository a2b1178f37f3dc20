"""Integrity of run directories: a flipped byte anywhere gives the undamaged answer or an error
naming the damaged file (exit 3), never a wrong answer; old runs without manifests still open."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from attnlab.analysis.pruning import prune_model, write_pruned_run
from attnlab.cli import main
from attnlab.errors import AttnlabWarning, CheckpointError, UsageError
from attnlab.evaluation.evaluate import evaluate
from attnlab.head_ids import head_ids
from attnlab.run.directory import RunDir
from attnlab.run.loaded import LoadedRun, open_run
from attnlab.run.manifest import read_manifest, record_of, write_manifest
from attnlab.run.storage import atomic_write_bytes, load_tensors, tensors_to_bytes
from attnlab.run.verification import verify_run
from attnlab.training.trainer import TrainingDiverged, train
from tests.tiny_run import build_tiny_run, tiny_experiment

CHECKPOINT = "checkpoints/step-00000004"
NEWLINE = b"\n"
RUN_FILES = ["config.json", "tokenizer.json", "model.safetensors", "manifest.json", "checkpoint.json"]
CHECKPOINT_FILES = [
    f"{CHECKPOINT}/{name}"
    for name in ("model.safetensors", "trainer_state.safetensors", "trainer_state.json", "manifest.json")
]


def _metrics(loaded: LoadedRun) -> dict:
    return evaluate(
        loaded.model,
        loaded.task,
        "test",
        kind=loaded.experiment.model_kind,
        batch_size=64,
        max_length=16,
        tokenizer=loaded.tokenizer,
        head_mask=loaded.held_mask(),
        progress=False,
    )


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in model.state_dict().items()}


def _checkpoint_state(run: Path) -> tuple[dict, dict, dict]:
    """What ``train --resume`` reads: the weights and the trainer state of the latest checkpoint."""
    opened = RunDir.open(run)
    files = opened.latest_checkpoint()
    loaded = open_run(run)  # a model of the right shape to load into
    opened.load_checkpoint_weights(loaded.model, files)
    tensors, state = opened.read_trainer_state(files)
    return _weights(loaded.model), tensors, state


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("integrity")
    experiment, run = build_tiny_run(folder)
    loaded = open_run(run)
    return {
        "folder": folder,
        "experiment": experiment,
        "run": run,
        "metrics": _metrics(loaded),
        "weights": _weights(loaded.model),
        "checkpoint": _checkpoint_state(run),
    }


@pytest.fixture
def copy(tiny, tmp_path) -> Path:
    """A private copy of the tiny run (hard links kept: model.safetensors is the checkpoint's)."""
    target = tmp_path / "run"
    shutil.copytree(tiny["run"], target)
    (target / "model.safetensors").unlink()
    (target / "model.safetensors").hardlink_to(target / CHECKPOINT / "model.safetensors")
    return target


def _offsets(size: int) -> list[int]:
    """8 offsets over the header and the data."""
    return sorted({0, 1, 9, min(40, size - 1), size // 3, size // 2, (2 * size) // 3, size - 1})


def _flip(path: Path, offset: int) -> bytes:
    data = path.read_bytes()
    damaged = bytearray(data)
    damaged[offset] ^= 0x01 if offset % 2 else 0x80
    path.write_bytes(bytes(damaged))
    return data


def _assert_names(error: CheckpointError, path: Path) -> None:
    assert str(path) in str(error), (str(error), path)
    assert "\n" not in str(error)


def test_the_tiny_run_verifies_clean_and_lists_every_file(tiny):
    report = verify_run(tiny["run"])
    assert report.ok and not report.warnings, report.to_dict()
    assert {check.path for check in report.files} >= set(RUN_FILES) | set(CHECKPOINT_FILES) | {"metrics.jsonl"}


@pytest.mark.parametrize("relative", RUN_FILES)
def test_a_flipped_byte_in_a_run_file_is_caught_or_harmless(tiny, copy, relative):
    path = copy / relative
    caught = 0
    for offset in _offsets(path.stat().st_size):
        original = _flip(path, offset)
        try:
            loaded = open_run(copy)
            # open_run does not read the pointer when model.safetensors is there; resume does
            RunDir.open(copy).latest_checkpoint()
        except CheckpointError as error:
            _assert_names(error, path)
            caught += 1
        else:
            assert _metrics(loaded) == tiny["metrics"], (relative, offset)
            for name, tensor in _weights(loaded.model).items():
                assert torch.equal(tensor, tiny["weights"][name]), (relative, offset, name)
        finally:
            path.write_bytes(original)
        assert not verify_run(copy).problems
    assert caught == len(_offsets(path.stat().st_size))  # every flip here changes what a command reads


@pytest.mark.parametrize("relative", CHECKPOINT_FILES)
def test_a_flipped_byte_in_a_checkpoint_file_is_caught_or_harmless(tiny, copy, relative):
    path = copy / relative
    weights, tensors, state = tiny["checkpoint"]
    caught = 0
    for offset in _offsets(path.stat().st_size):
        original = _flip(path, offset)
        try:
            got_weights, got_tensors, got_state = _checkpoint_state(copy)
        except CheckpointError as error:
            caught += 1
            if relative.endswith("/model.safetensors"):  # one file with the run's model.safetensors (a hard link)
                assert str(path) in str(error) or str(copy / "model.safetensors") in str(error), str(error)
            else:
                _assert_names(error, path)
        else:
            assert got_state == state, (relative, offset)
            assert all(torch.equal(got_weights[n], weights[n]) for n in weights), (relative, offset)
            assert all(torch.equal(got_tensors[n], tensors[n]) for n in tensors), (relative, offset)
        finally:
            path.write_bytes(original)
    assert caught == len(_offsets(path.stat().st_size))


def test_the_verify_report_names_each_damaged_file(copy):
    for relative in ["config.json", f"{CHECKPOINT}/trainer_state.json"]:
        original = _flip(copy / relative, 5)
        report = verify_run(copy)
        assert [check.path for check in report.problems] == [relative]
        (copy / relative).write_bytes(original)


def test_a_flipped_trainer_state_on_resume_names_the_file_not_a_divergence(tiny, copy):
    path = copy / CHECKPOINT / "trainer_state.safetensors"
    _flip(path, path.stat().st_size - 3)  # the data of the last tensor
    with pytest.raises(CheckpointError) as caught:
        train(tiny_experiment(tiny["folder"], steps=6), copy, resume=True, progress=False)
    assert not isinstance(caught.value, TrainingDiverged)
    _assert_names(caught.value, path)


def test_a_run_without_manifests_warns_once_and_works(tiny, copy):
    """A run written before manifests: no manifest.json anywhere."""
    for manifest in copy.rglob("manifest.json"):
        manifest.unlink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = open_run(copy)
    messages = [str(w.message) for w in caught if issubclass(w.category, AttnlabWarning)]
    assert len(messages) == 1 and "manifest.json" in messages[0] and str(copy) in messages[0]
    assert _metrics(loaded) == tiny["metrics"]
    report = verify_run(copy)
    assert report.ok and report.warnings


def test_resuming_an_old_run_warns_once_and_gives_it_manifests(copy, capsys, monkeypatch):
    for manifest in copy.rglob("manifest.json"):
        manifest.unlink()
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # main() replaces it
    with warnings.catch_warnings():
        warnings.simplefilter("default", AttnlabWarning)  # Python's own filter: once per place
        with pytest.raises(SystemExit) as exited:
            main(["train", "--resume", str(copy), "--set", "train.steps=6", "--no-progress"])
    err = capsys.readouterr().err
    assert exited.value.code in (0, None), err
    assert [line for line in err.splitlines() if line.startswith("warning:")] == [
        f"warning: run {copy} has no manifest.json (written before attnlab verified run files): "
        "its files are read unverified"
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error", AttnlabWarning)
        open_run(copy)
    assert verify_run(copy).ok


@pytest.mark.parametrize("relative", ["config.json", "tokenizer.json", "model.safetensors"])
def test_a_file_replaced_by_a_folder_is_named(copy, relative):
    (copy / relative).unlink()
    (copy / relative).mkdir()
    with pytest.raises(CheckpointError, match="not a regular file") as caught:
        open_run(copy)
    _assert_names(caught.value, copy / relative)
    assert [check.path for check in verify_run(copy).problems] == [relative]


@pytest.mark.parametrize("manifest", [True, False])
def test_a_deeply_nested_config_is_named(copy, manifest):
    if not manifest:
        (copy / "manifest.json").unlink()
    (copy / "config.json").write_text("[" * 100_000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AttnlabWarning)
        with pytest.raises(CheckpointError) as caught:
            open_run(copy)
    _assert_names(caught.value, copy / "config.json")


def test_a_missing_listed_file_is_named(copy):
    (copy / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="not found") as caught:
        open_run(copy)
    _assert_names(caught.value, copy / "tokenizer.json")


def test_weights_published_before_the_manifest_records_them_are_accepted(tiny, copy):
    """A kill between publishing model.safetensors and recording it in manifest.json: the weights
    are the pointed checkpoint's, the manifest still has the previous checkpoint's record."""
    previous = read_manifest(copy / "checkpoints/step-00000002")
    write_manifest(copy, read_manifest(copy).with_records({"model.safetensors": previous.files["model.safetensors"]}))
    assert _metrics(open_run(copy)) == tiny["metrics"]
    assert verify_run(copy).ok


def test_garbage_in_metrics_names_file_and_line_and_a_torn_line_is_dropped_on_resume(tiny, copy):
    metrics = copy / "metrics.jsonl"
    lines = metrics.read_bytes().count(b"\n")
    original = metrics.read_bytes()
    metrics.write_bytes(original + b"\x9f\xff garbage \x00\n" + b'{"step": 9}\n')
    with pytest.raises(CheckpointError, match=f"{metrics}:{lines + 1}: bytes that are not UTF-8"):
        train(tiny_experiment(tiny["folder"], steps=6), copy, resume=True, progress=False)
    metrics.write_bytes(original + b"\x01\x02 random")
    with pytest.raises(CheckpointError, match=f"{metrics}:{lines + 1}:"):
        RunDir.open(copy).read_metrics()
    metrics.write_bytes(original + b'{"step": 5, "lo')  # what a kill mid-append leaves
    train(tiny_experiment(tiny["folder"], steps=6), copy, resume=True, progress=False)
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == sorted(steps) and steps[-1] == 6 and steps.count(5) == 1


def test_a_pruned_run_has_a_manifest_and_verifies(tiny, tmp_path):
    loaded = open_run(tiny["run"])
    pruned = [head_ids(loaded.model)[0]]
    out = write_pruned_run(loaded, prune_model(loaded.model, pruned), tmp_path / "pruned", pruned=pruned).path
    assert set(read_manifest(out).files) == {"config.json", "tokenizer.json", "model.safetensors"}
    assert verify_run(out).ok
    open_run(out)


def _with_the_names_before_the_decoder_rename(run: Path) -> None:
    """Rewrite ``run``'s weights as attnlab wrote them while DecoderOnly's stack was called ``body``:
    each checkpoint's model.safetensors with ``body.*`` keys (aliases too) and its manifest record,
    then the published copy and its record (as ``RunDir.point_to`` does)."""

    def old(name: str) -> str:
        return "body." + name[len("decoder.") :] if name.startswith("decoder.") else name

    opened = RunDir.open(run)
    for files in opened.checkpoints():
        tensors, metadata = load_tensors(files.model)
        aliases = json.loads(metadata["attnlab.aliases"])
        metadata = {**metadata, "attnlab.aliases": json.dumps({old(a): old(c) for a, c in aliases.items()})}
        data = tensors_to_bytes({old(name): tensor for name, tensor in tensors.items()}, metadata)
        atomic_write_bytes(files.model, data)
        manifest = read_manifest(files.directory)
        written = write_manifest(files.directory, manifest.with_records({files.model.name: record_of(data)}))
        listing = {f"checkpoints/{files.directory.name}/manifest.json": record_of(written.read_bytes())}
        write_manifest(run, read_manifest(run).with_records(listing))  # as point_to recorded it then
    opened.point_to(opened.latest_checkpoint())


def test_a_run_written_before_the_decoder_rename_opens_verifies_and_resumes(tiny, copy, tmp_path):
    """Weights whose keys are ``body.*`` load as ``decoder.*``: the same weights and metrics, the
    run verifies unchanged (the files are never rewritten), and a resume equals the new run's."""
    reference = Path(shutil.copytree(copy, tmp_path / "reference"))
    _with_the_names_before_the_decoder_rename(copy)
    for weights in [copy / "model.safetensors", *copy.glob("checkpoints/*/model.safetensors")]:
        names = load_tensors(weights)[0].keys()
        assert "body.embedding.token.weight" in names and not any(n.startswith("decoder.") for n in names)
    loaded = open_run(copy)
    assert _weights(loaded.model).keys() == tiny["weights"].keys()
    for name, tensor in _weights(loaded.model).items():
        assert torch.equal(tensor, tiny["weights"][name]), name
    assert _metrics(loaded) == tiny["metrics"]
    weights, _, state = _checkpoint_state(copy)
    assert state == tiny["checkpoint"][2] and all(torch.equal(t, weights[n]) for n, t in tiny["checkpoint"][0].items())
    assert verify_run(copy).ok
    for run in (reference, copy):
        train(tiny_experiment(tiny["folder"], steps=6), run, resume=True, progress=False)
    resumed, expected = _weights(open_run(copy).model), _weights(open_run(reference).model)
    assert resumed.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(resumed[name], tensor), name


def _rewrite_trainer_state(run: Path, change) -> None:
    """Rewrite each checkpoint's trainer_state.json with ``change(state)``, and the records of it
    (its checkpoint's manifest, that manifest's record in the run's), as attnlab wrote them then."""
    for folder in sorted((run / "checkpoints").glob("step-*")):
        path = folder / "trainer_state.json"
        data = (json.dumps(change(json.loads(path.read_text())), indent=2, sort_keys=True) + "\n").encode()
        path.write_bytes(data)
        written = write_manifest(folder, read_manifest(folder).with_records({path.name: record_of(data)}))
        listing = {f"checkpoints/{folder.name}/manifest.json": record_of(written.read_bytes())}
        write_manifest(run, read_manifest(run).with_records(listing))


def test_checkpoints_written_before_metrics_were_recorded_warn_once_and_resume(tiny, copy):
    _rewrite_trainer_state(copy, lambda state: {k: v for k, v in state.items() if k != "metrics"})
    with open(copy / "metrics.jsonl", "a") as handle:
        handle.write('{"loss": 9.0, "step": 5}\n')  # after the checkpoint: dropped on resume, as before
    report = verify_run(copy)
    assert report.ok and len(report.warnings) == 1 and "records no metrics.jsonl" in report.warnings[0]
    assert "no checkpoint records this file yet" in next(c.detail for c in report.files if c.path == "metrics.jsonl")
    with pytest.warns(AttnlabWarning, match="records no metrics.jsonl"):
        train(tiny_experiment(tiny["folder"], steps=6), copy, resume=True, progress=False)
    steps = [r["step"] for r in RunDir.open(copy).read_metrics()]
    assert steps == sorted(steps) and steps.count(5) == 1 and steps[-1] == 6
    report = verify_run(copy)
    assert report.ok and not report.warnings


def test_resume_keeps_exactly_the_recorded_metrics_and_refuses_changed_ones(tiny, copy):
    metrics = copy / "metrics.jsonl"
    original = metrics.read_bytes()
    metrics.write_bytes(original.replace(b'"step": 3', b'"step": 8', 1))  # a changed digit: still JSON
    with pytest.raises(CheckpointError, match=f"metrics {metrics} is damaged: its first {len(original)} bytes differ"):
        train(tiny_experiment(tiny["folder"], steps=6), copy, resume=True, progress=False)
    metrics.write_bytes(original + b'{"loss": 1.0, "step": 5}\n{"loss": 1.0, "step": 6}\n')  # a killed run's
    train(tiny_experiment(tiny["folder"], steps=6), copy, resume=True, progress=False)
    resumed = metrics.read_bytes()
    assert resumed.startswith(original) and b'"loss": 1.0' not in resumed
    report = verify_run(copy)
    detail = next(check.detail for check in report.files if check.path == "metrics.jsonl")
    assert report.ok and detail == f"{resumed.count(NEWLINE)} lines as checkpoint step-00000006 recorded them"


@pytest.mark.parametrize("stop_in", ["point_to", "_record"])
def test_a_kill_while_a_checkpoint_is_committed_leaves_a_run_that_verifies(tiny, copy, monkeypatch, stop_in):
    """Killed after the checkpoint folder is renamed into place (before the pointer moves), or
    after the pointer moved (before the run's manifest records it): the run verifies and resumes."""
    original = getattr(RunDir, stop_in)

    def killed(self, *args, **kwargs):
        if stop_in == "point_to" or "model.safetensors" in args[0]:
            raise KeyboardInterrupt  # stands for kill -9: nothing after this point runs
        return original(self, *args, **kwargs)

    monkeypatch.setattr(RunDir, stop_in, killed)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_experiment(tiny["folder"], steps=6), copy, resume=True, progress=False)
    monkeypatch.undo()
    assert (copy / "checkpoints/step-00000006/manifest.json").exists()
    pointed = json.loads((copy / "checkpoint.json").read_text())["step"]
    assert pointed == (4 if stop_in == "point_to" else 6)
    report = verify_run(copy)
    assert report.ok, report.problems
    train(tiny_experiment(tiny["folder"], steps=6), copy, resume=True, progress=False)
    assert verify_run(copy).ok


def test_checkpoint_last_without_the_pointer_says_what_is_available(copy):
    (copy / "checkpoint.json").unlink()
    with pytest.raises(CheckpointError, match="checkpoint pointer not found: .*lists step-00000002, step-00000004"):
        RunDir.open(copy).choose_checkpoint("last")
    for manifest in copy.rglob("manifest.json"):  # a run written before manifests: the pointer is not required
        manifest.unlink()
    with pytest.raises(UsageError) as caught:
        RunDir.open(copy).choose_checkpoint("last")
    assert str(caught.value) == (
        f"--checkpoint last: {copy} has no checkpoint.json (which names the last checkpoint); "
        "available: best, step-2, step-4"
    )
