"""Checkpoint round trip and damaged artifacts."""

import json

import pytest
import torch

from fedavg.models.registry import build_model
from fedavg.run import checkpoint
from fedavg.use.inference import load_model
from fedavg.util.errors import UserError

META = {
    "model": {"name": "cnn-cifar", "input_shape": [3, 32, 32], "num_classes": 4, "args": {}},
    "classes": ["a", "b", "c", "d"],
    "input": {"shape": [3, 32, 32], "dtype": "uint8", "scale": 1 / 255,
              "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]},
}


def test_round_trip_weights_dtypes_and_meta(tmp_path):
    model = build_model("resnet18", (3, 32, 32), 4)
    sd = model.state_dict()
    meta = {**META, "model": {**META["model"], "name": "resnet18"}, "rounds": 3}
    checkpoint.save(tmp_path, sd, meta)
    loaded, meta2 = checkpoint.load(tmp_path)
    assert set(loaded) == set(sd)
    for k, v in sd.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), k
    assert meta2["rounds"] == 3 and meta2["classes"] == META["classes"]
    assert meta2["format"].startswith("fedavg-model/")
    # nothing but the artifacts is needed to rebuild the model
    rebuilt = load_model(tmp_path)
    x = torch.randn(2, 3, 32, 32)
    model.eval()
    assert torch.allclose(rebuilt(x), model(x))
    assert rebuilt.fedavg_meta["classes"] == ["a", "b", "c", "d"]
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes leave no temporary files


def test_corrupt_weights(tmp_path):
    checkpoint.save(tmp_path, build_model("cnn-cifar", (3, 32, 32), 4).state_dict(), META)
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(UserError, match="damaged"):
        checkpoint.load(tmp_path)


def test_flipped_weight_bytes_are_refused_and_old_models_still_load(tmp_path):
    """Bytes changed inside the weights (the header intact) were scored with no word.

    The model file itself stays byte-for-byte the same for the same weights (a resumed run
    equals an unbroken one): the checksum is in model.json.
    """
    from safetensors.torch import save_file

    sd = build_model("cnn-cifar", (3, 32, 32), 4).state_dict()
    checkpoint.save(tmp_path, sd, META)
    path = tmp_path / "model.safetensors"
    checkpoint.save(tmp_path / "again", sd, META)
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == path.read_bytes()
    data = bytearray(path.read_bytes())
    data[-2000:-1000] = bytes(b ^ 0x5A for b in data[-2000:-1000])
    path.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"model.safetensors does not match the SHA-256 that "
                                        r".*model.json records: it is damaged, or another"):
        checkpoint.load(tmp_path)
    other = tmp_path / "other"  # another run's model file copied in: scored with no word
    checkpoint.save(other, build_model("cnn-cifar", (3, 32, 32), 4).state_dict(), META)
    path.write_bytes((other / "model.safetensors").read_bytes())
    with pytest.raises(UserError, match=r"does not match the SHA-256 .*another run's model "
                                        r"file: put back this run's"):
        checkpoint.load(tmp_path)
    save_file(checkpoint.storable(sd), str(path), metadata={"format": checkpoint.FORMAT})
    meta = json.loads((tmp_path / "model.json").read_text())
    del meta["weights_sha256"]
    (tmp_path / "model.json").write_text(json.dumps(meta))
    loaded, _ = checkpoint.load(tmp_path)  # saved before models had a checksum: no check
    assert all(torch.equal(loaded[k], v) for k, v in sd.items())


def test_the_checksum_covers_a_lora_models_adapter_settings(tmp_path):
    """An edited LoRA alpha (or rank, targets) changes what the weights compute: refused."""
    sd = build_model("mlp", (1, 8, 8), 10).state_dict()
    lora = {"rank": 8, "alpha": 16.0, "dropout": 0.0, "targets": ["fc1"], "merge": "exact",
            "head": "fc2", "base_sha256": "ab" * 32}
    meta = {**META, "model": {**META["model"], "lora": lora}}
    checkpoint.save(tmp_path, sd, meta)
    checkpoint.load(tmp_path)  # as saved: loads
    saved = json.loads((tmp_path / "model.json").read_text())
    edited = json.loads(json.dumps(saved))
    edited["model"]["lora"]["alpha"] = 32.0
    (tmp_path / "model.json").write_text(json.dumps(edited))
    with pytest.raises(UserError, match=r"or its LoRA settings \(model.lora\) were edited"):
        checkpoint.load(tmp_path)
    # a LoRA model of an earlier fedavg pinned its weights alone: it still loads
    saved["weights_sha256"] = checkpoint.tensor_digest(checkpoint.storable(sd))
    (tmp_path / "model.json").write_text(json.dumps(saved))
    checkpoint.load(tmp_path)


def test_truncated_weights(tmp_path):
    checkpoint.save(tmp_path, build_model("cnn-cifar", (3, 32, 32), 4).state_dict(), META)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="safetensors"):
        checkpoint.load(tmp_path)


def test_missing_and_bad_meta(tmp_path):
    with pytest.raises(UserError, match="no such model folder"):
        checkpoint.load(tmp_path / "nope")
    with pytest.raises(UserError, match="model.safetensors"):
        checkpoint.load(tmp_path)
    checkpoint.save(tmp_path, {"w": torch.zeros(1)}, META)
    (tmp_path / "model.json").write_text("{not json")
    with pytest.raises(UserError, match="JSON"):
        checkpoint.load(tmp_path)
    (tmp_path / "model.json").write_text(json.dumps({"format": "fedavg-model/1"}))
    with pytest.raises(UserError, match="lacks"):
        checkpoint.load(tmp_path)


@pytest.mark.parametrize("fmt, message", [
    ("fedavg-model/2", "format fedavg-model/2, written by a newer fedavg; this one reads "
                       "fedavg-model/1: upgrade fedavg"),
    ("fedavg-model/x", "its 'format' is 'fedavg-model/x', not 'fedavg-model/1'"),
    ("fedavg-modelling/1", "is not a fedavg model description"),
    ("fedavg-model/\u00b2", "is not a fedavg model description"),  # a digit int() refuses
    ("fedavg-model/0", "is not a fedavg model description"),
    ("fedavg-model/1.5", "is not a fedavg model description"),
    (None, "its 'format' is None, not 'fedavg-model/1'"),
    (1, "is not a fedavg model description"),
])
def test_model_descriptions_of_other_formats_are_refused(tmp_path, fmt, message):
    checkpoint.save(tmp_path, {"w": torch.zeros(1)}, META)
    meta = json.loads((tmp_path / "model.json").read_text())
    meta["format"] = fmt
    (tmp_path / "model.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=message):
        checkpoint.load(tmp_path)


def test_weights_that_do_not_fit_the_model(tmp_path):
    checkpoint.save(tmp_path, {"w": torch.zeros(1)}, META)
    with pytest.raises(UserError, match="does not fit the 'cnn-cifar' model") as info:
        load_model(tmp_path)
    assert "has 1 tensor(s) the model does not: 'w'" in str(info.value)
    assert "lacks 10 tensor(s) the model has: '0.0.weight', '0.0.bias', '0.3.weight' and 7 " \
        "more" in str(info.value)


def test_json_files_hold_no_nan_or_infinity(tmp_path):
    """A NaN loss is ``null`` in metrics.jsonl and summary.json: strict JSON readers refuse NaN."""
    import json
    import math

    from fedavg.run.checkpoint import write_json
    from fedavg.run.lifecycle import RoundRecord

    record = RoundRecord(round=1, accuracy=0.078, loss=math.nan, train_loss=math.inf,
                         num_nodes=2, num_failed=0, wall_s=0.5)
    line = json.dumps(record.as_dict(), allow_nan=False)  # raises on NaN
    assert json.loads(line)["loss"] is None and json.loads(line)["train_loss"] is None
    assert json.loads(line)["accuracy"] == 0.078
    write_json(tmp_path / "s.json", {"loss": math.nan, "rounds": [1.5, -math.inf],
                                     "nested": {"x": math.inf}})

    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the file"))

    assert strict((tmp_path / "s.json").read_text()) == {"loss": None, "rounds": [1.5, None],
                                                         "nested": {"x": None}}


def test_a_run_finished_by_another_command_meanwhile_is_not_replaced(tmp_path, monkeypatch):
    """A command that checked its folder at the start rechecks it once it holds the lock.

    The data loaded for a while in between, and a run another command finished meanwhile
    was replaced, without --overwrite.
    """
    import fedavg
    from fedavg.run import lifecycle as run
    from fedavg.run.output import make_output, release_output

    out = tmp_path / "race"
    real_prepare = run.prepare

    def prepare_while_another_run_finishes(config, **kwargs):
        prepared = real_prepare(config, **kwargs)
        out.mkdir()
        (out / "model.safetensors").write_bytes(b"the other run's model")
        return prepared

    monkeypatch.setattr(run, "prepare", prepare_while_another_run_finishes)
    with pytest.raises(UserError, match="already holds a run; choose another output or pass "
                                        "overwrite"):  # the Python API's names
        fedavg.simulate(fedavg.RunConfig().replace(rounds=1, num_nodes=2), output=out,
                        console=None)
    assert (out / "model.safetensors").read_bytes() == b"the other run's model"
    make_output(out, lock=True)  # the refused command let go of the folder's lock
    release_output(out)
