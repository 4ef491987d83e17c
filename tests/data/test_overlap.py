"""Evaluation samples that are also training samples: counted, and said by runs and evaluate."""

import json

import numpy as np
from PIL import Image
from typer.testing import CliRunner

from fedavg.config.settings import RunConfig
from fedavg.data.load import load
from fedavg.data.overlap import overlap_note, shared_inputs
from fedavg.models.registry import build_model
from fedavg.run import checkpoint
from fedavg.run.lifecycle import prepare


def test_shared_inputs_counts_each_evaluation_input_found_in_train():
    train = np.array([[1, 2], [7, 8], [1, 2]], dtype=np.uint8)
    x = np.array([[1, 2], [3, 4], [1, 2], [8, 7], [7, 8]], dtype=np.uint8)
    assert shared_inputs(x, train) == 3  # [1, 2] twice, [7, 8] once; [8, 7] is not [7, 8]
    assert shared_inputs(x, np.zeros((0, 2), dtype=np.uint8)) == 0
    assert shared_inputs(x.astype(np.float32), train) == 0  # other inputs altogether
    images = np.arange(2 * 1 * 2 * 2, dtype=np.float32).reshape(2, 1, 2, 2)
    assert shared_inputs(images[1:], images) == 1
    assert overlap_note(x[1:2], train, "test", "d") is None
    assert overlap_note(x, train, "validation", "d") == (
        "validation split of d: 3 of 5 samples have the same input as a train sample, so "
        "accuracy on it overstates accuracy on unseen data")


def _image_folder(root, copies: int):
    """Write train/ (40 digits) and test/ (10 digits, the first ``copies`` of them train's)."""
    digits = load("digits", seed=0)
    x, y = digits.train.x[:, 0], digits.train.y
    test = [(x[i], y[i]) for i in range(copies)] + [(x[40 + i], y[40 + i])
                                                   for i in range(10 - copies)]
    for split, samples in (("train", list(zip(x[:40], y[:40]))), ("test", test)):
        for i, (image, label) in enumerate(samples):
            folder = root / split / str(label)
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image).save(folder / f"{i}.png")
    return root


def test_a_run_says_when_test_samples_are_train_samples(tmp_path):
    leaky = _image_folder(tmp_path / "leaky", copies=3)
    prepared = prepare(RunConfig().replace(dataset=str(leaky), num_nodes=2, model="mlp"))
    assert f"test split of {leaky}: 3 of 10 samples have the same input as a train sample, " \
           "so accuracy on it overstates accuracy on unseen data" in prepared.data.notes
    clean = _image_folder(tmp_path / "clean", copies=0)
    prepared = prepare(RunConfig().replace(dataset=str(clean), num_nodes=2, model="mlp"))
    assert not [n for n in prepared.data.notes if "same input as a train sample" in n]


def test_evaluate_says_when_the_split_holds_train_samples(tmp_path):
    from fedavg.cli.app import build_app

    leaky = _image_folder(tmp_path / "leaky", copies=3)
    meta = {"model": {"name": "mlp", "input_shape": [1, 8, 8], "num_classes": 10, "args": {}},
            "classes": [str(i) for i in range(10)],
            "input": {"shape": [1, 8, 8], "dtype": "uint8", "scale": 1 / 255, "mean": [0.3],
                      "std": [0.4]}}
    model = checkpoint.save(tmp_path / "m", build_model("mlp", (1, 8, 8), 10).state_dict(), meta)
    app, runner = build_app(), CliRunner()
    text = runner.invoke(app, ["evaluate", str(model), "--dataset", str(leaky)])
    assert text.exit_code == 0, text.output
    assert "note: test split of" in text.stderr and "3 of 10 samples" in text.stderr
    as_json = runner.invoke(app, ["evaluate", str(model), "--dataset", str(leaky), "--json"])
    [note] = json.loads(as_json.stdout)["notes"]
    assert note.endswith("3 of 10 samples have the same input as a train sample, so accuracy "
                         "on it overstates accuracy on unseen data")
    train = runner.invoke(app, ["evaluate", str(model), "--dataset", str(leaky), "--split",
                                "train", "--json"])
    assert json.loads(train.stdout)["notes"] == []  # the train split is train data, said or not
