"""RunDir and storage: atomic writes, tied weights, checkpoint pointer, corruption gives CheckpointError."""

from __future__ import annotations

import hashlib
import os
import pickle
import random

import pytest
import torch

from attnlab.errors import CheckpointError, UsageError
from attnlab.nn import DecoderOnly, DecoderOnlyConfig
from attnlab.run.directory import RunDir
from attnlab.run.manifest import read_manifest, record_of
from attnlab.run.storage import atomic_write_text, load_tensors, save_tensors
from attnlab.run.weights import load_weights_into

CFG = DecoderOnlyConfig(vocab_size=7, layers=1, d_model=8, heads=2, d_ff=8, tie_embeddings=True)
EMPTY_METRICS = {"lines": 0, "size": 0, "sha256": hashlib.sha256(b"").hexdigest()}  # no metrics.jsonl yet


@pytest.fixture
def run(tmp_path):
    r = RunDir.create(tmp_path / "run")
    r.write_config({"model": {"kind": "decoder_only"}})
    return r


def test_weights_round_trip_with_tied_embeddings(run):
    model = DecoderOnly(CFG)
    run.save_weights(model)
    other = DecoderOnly(CFG)
    run.load_weights(other)
    for (name, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), name
    assert other.lm_head.weight is other.decoder.embedding.token.weight  # still tied after loading


def test_loaded_weights_are_the_mapped_file_and_writes_leave_it_unchanged(run):
    """The weights are memory-mapped, not copied: the model computes what the saved model does,
    a write to a loaded weight changes the model only (copy on write), and the file still verifies."""
    model = DecoderOnly(CFG).eval()
    run.save_weights(model)
    other = DecoderOnly(CFG).eval()
    run.load_weights(other)
    tokens = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(other(tokens), model(tokens))
    with torch.no_grad():
        other.lm_head.weight.zero_()
    assert float(other.decoder.embedding.token.weight.detach().abs().sum()) == 0.0  # tied: one parameter
    third = DecoderOnly(CFG).eval()
    run.load_weights(third)
    assert torch.equal(third(tokens), model(tokens))


def test_weights_replaced_while_loading_are_refused(run, monkeypatch):
    import attnlab.run.reading as runs

    model = DecoderOnly(CFG)
    run.save_weights(model)
    mapped = runs.map_tensors

    def map_then_replace(path, **kwargs):
        found = mapped(path, **kwargs)
        os.replace(str(path) + ".copy", path) if os.path.exists(str(path) + ".copy") else None
        return found

    with open(run.path / "model.safetensors", "rb") as handle:
        (run.path / "model.safetensors.copy").write_bytes(handle.read())
    monkeypatch.setattr(runs, "map_tensors", map_then_replace)
    with pytest.raises(CheckpointError, match="changed while they were read"):
        run.load_weights(DecoderOnly(CFG))


def test_checkpoint_pointer_and_pruning(run):
    model = DecoderOnly(CFG)
    for step in (10, 20, 30):
        files = run.write_checkpoint(step, model, {"t": torch.tensor([step])}, {"note": "x"}, keep=2)
    assert run.latest_checkpoint().step == 30 == files.step
    assert sorted(p.name for p in (run.path / "checkpoints").iterdir()) == ["step-00000020", "step-00000030"]
    tensors, state = run.read_trainer_state(files)
    assert tensors["t"].item() == 30 and state == {"note": "x", "step": 30, "metrics": EMPTY_METRICS}
    assert (run.path / "model.safetensors").samefile(files.model)  # published as a hard link


def test_checkpoint_and_run_manifests_record_the_bytes_written(run):
    files = run.write_checkpoint(10, DecoderOnly(CFG), {"t": torch.tensor([10])}, {"note": "x"})
    checkpoint = read_manifest(files.directory)
    assert set(checkpoint.files) == {"model.safetensors", "trainer_state.safetensors", "trainer_state.json"}
    for name, record in checkpoint.files.items():
        assert record == record_of((files.directory / name).read_bytes())
    top = read_manifest(run.path)
    assert set(top.files) == {"config.json", "model.safetensors", "checkpoints/step-00000010/manifest.json"}
    assert top.files["checkpoints/step-00000010/manifest.json"] == record_of(
        (files.directory / "manifest.json").read_bytes()
    )
    assert top.files["model.safetensors"] == checkpoint.files["model.safetensors"]
    assert top.files["config.json"] == record_of((run.path / "config.json").read_bytes())
    assert run.read_verified("checkpoints/step-00000010/trainer_state.json") == files.trainer_json.read_bytes()


def test_metrics_append_truncate_and_torn_last_line(run):
    for step in (1, 2, 3):
        run.append_metrics({"step": step, "loss": 1.0 / step})
    with open(run.path / RunDir.METRICS, "a") as handle:
        handle.write('{"step": 4, "lo')  # a crash mid-write
    assert [r["step"] for r in run.read_metrics()] == [1, 2, 3]
    run.truncate_metrics(2)
    assert [r["step"] for r in run.read_metrics()] == [1, 2]


def test_open_errors(tmp_path):
    with pytest.raises(UsageError, match="run not found"):
        RunDir.open(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="no config.json"):
        RunDir.open(tmp_path / "empty")
    RunDir.create(tmp_path / "busy").write_config({})
    with pytest.raises(UsageError, match="not empty"):
        RunDir.create(tmp_path / "busy")
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(UsageError, match="is a file; choose another --out"):
        RunDir.create(tmp_path / "a-file")


def test_every_truncation_is_a_clear_error(tmp_path):
    path = tmp_path / "w.safetensors"
    save_tensors(path, {"a": torch.arange(6.0), "b": torch.ones(2, 2, dtype=torch.int64)}, {"k": "v"})
    data = path.read_bytes()
    for length in range(len(data)):
        path.write_bytes(data[:length])
        with pytest.raises(CheckpointError, match="corrupted or not a safetensors file"):
            load_tensors(path)


def test_byte_flips_are_errors_or_harmless(tmp_path):
    """A flipped byte either breaks the header (clear error) or changes tensor bytes (still loads)."""
    path = tmp_path / "w.safetensors"
    save_tensors(path, {"a": torch.arange(16.0)})
    data = path.read_bytes()
    rng = random.Random(0)
    for _ in range(300):
        flipped = bytearray(data)
        flipped[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(flipped))
        try:
            tensors, _ = load_tensors(path)
        except CheckpointError:
            continue
        assert all(isinstance(t, torch.Tensor) for t in tensors.values())  # well-formed, nothing crashed


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch /tmp/attnlab-pwned",))


def test_pickle_payload_is_rejected_and_not_executed(tmp_path, run):
    marker = "/tmp/attnlab-pwned"
    if os.path.exists(marker):
        os.remove(marker)
    for payload in (pickle.dumps(_Exploit()), pickle.dumps({"x": 1})):
        (run.path / "model.safetensors").write_bytes(payload)
        with pytest.raises(CheckpointError):
            run.load_weights(DecoderOnly(CFG))
    torch.save({"weight": torch.ones(2)}, tmp_path / "torch.pt")
    with pytest.raises(CheckpointError):
        load_weights_into(DecoderOnly(CFG), tmp_path / "torch.pt")
    assert not os.path.exists(marker)


def test_shape_mismatch_names_the_tensor(run):
    run.save_weights(DecoderOnly(CFG))
    bigger = DecoderOnly(CFG.replace(d_ff=16))
    with pytest.raises(
        CheckpointError,
        match=r"tensor 'decoder.layers.0.feed_forward.linear1.weight' has shape \(8, 8\), the model expects \(16, 8\)",
    ):
        run.load_weights(bigger)


def _named_as_before_the_decoder_rename(model: DecoderOnly) -> torch.nn.Module:
    """``model``'s modules under the names they had while DecoderOnly's stack was ``body``: its
    state dict is ``body.*`` and ``lm_head.weight``, tied tensors still one."""
    old = torch.nn.Module()
    old.body, old.lm_head = model.decoder, model.lm_head
    return old


def test_weights_with_the_names_before_the_decoder_rename_load_unchanged(run):
    """``body.*`` weights (model.safetensors and a checkpoint's) give the same logits; the file is
    read as written (its manifest record still verifies)."""
    model = DecoderOnly(CFG).eval()
    old = _named_as_before_the_decoder_rename(model)
    run.save_weights(old)
    files = run.write_checkpoint(3, old, {}, {})
    for path in (run.path / "model.safetensors", files.model):
        tensors, metadata = load_tensors(path)
        assert "body.embedding.token.weight" in tensors and not any(n.startswith("decoder.") for n in tensors)
        assert "body.embedding.token.weight" in metadata["attnlab.aliases"]  # the tied output layer's source
    tokens = torch.tensor([[1, 2, 3, 4], [4, 3, 2, 1]])
    for load in (run.load_weights, lambda m: run.load_checkpoint_weights(m, files)):
        other = DecoderOnly(CFG).eval()
        assert not torch.equal(other(tokens), model(tokens))
        load(other)
        assert torch.equal(other(tokens), model(tokens))
        assert other.lm_head.weight is other.decoder.embedding.token.weight
    written = (run.path / "model.safetensors").read_bytes()
    assert read_manifest(run.path).files["model.safetensors"] == record_of(written)


def test_old_names_are_renamed_only_in_weights_without_the_new_ones(run):
    """A ``body.*`` key beside ``decoder.*`` keys is not a renamed key: it is named as unexpected."""
    state = dict(DecoderOnly(CFG).state_dict())
    run.save_state_dict({**state, "body.extra": torch.zeros(1)})
    with pytest.raises(CheckpointError, match=r"unexpected \['body.extra'\]"):
        run.load_weights(DecoderOnly(CFG))


def test_atomic_write_leaves_old_file_on_failure(tmp_path):
    path = tmp_path / "f.txt"
    atomic_write_text(path, "old")

    class Boom(Exception):
        pass

    from attnlab.run import storage

    def failing_write(handle):
        handle.write("partial")
        raise Boom

    with pytest.raises(Boom):
        storage.atomic_write(path, failing_write)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]  # no temporary left behind


def test_the_run_manifest_lists_exactly_the_committed_checkpoints(run):
    """Each checkpoint is required from its commit on and forgotten before it is pruned."""
    model = DecoderOnly(CFG)
    for step in (10, 20, 30):
        run.write_checkpoint(step, model, {"t": torch.tensor([step])}, {"note": "x"}, keep=2)
    assert run.committed_checkpoints() == ["step-00000020", "step-00000030"]
    (run.path / "checkpoints" / "step-00000020" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="manifest not found: .*step-00000020/manifest.json .*committed"):
        run.read_trainer_state(run.checkpoints()[0])
    (run.path / "checkpoint.json").unlink()
    with pytest.raises(CheckpointError, match="checkpoint pointer not found"):
        run.latest_checkpoint()
