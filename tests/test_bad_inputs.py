"""Bad files and inputs as a new user meets them: each is one line that says what to fix.

Natural partitions with more ids than nodes, weights that do not fit their model, image
folders with empty classes or stray files, library progress bars, damaged model files.
"""

import json
import re
import struct

import numpy as np
import pytest
import torch
from conftest import assert_one_error_line, run_cli
from PIL import Image
from typer.testing import CliRunner

from fedavg.cli.app import app
from fedavg.config.settings import RunConfig
from fedavg.data.load import load
from fedavg.data.partition import group_values, partition, values_per_node
from fedavg.models.registry import build_model
from fedavg.run import checkpoint
from fedavg.run.display import natural_note, partition_table
from fedavg.run.lifecycle import prepare
from fedavg.util.errors import UserError

META = {
    "model": {"name": "mlp", "input_shape": [1, 8, 8], "num_classes": 10, "args": {}},
    "classes": [str(i) for i in range(10)],
    "input": {"shape": [1, 8, 8], "dtype": "uint8", "scale": 1 / 255, "mean": [0.3],
              "std": [0.4]},
}


def digits_with_writers(path, writers=13):
    """scikit-learn digits as a Parquet table: 64 pixel columns, label, a writer column."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from sklearn.datasets import load_digits

    bunch = load_digits()
    columns = {f"p{i}": bunch.data[:, i].astype(np.float32) for i in range(64)}
    columns["label"] = bunch.target.astype(np.int64)
    columns["writer"] = np.array([f"w{i % writers:02d}" for i in range(len(bunch.target))])
    pq.write_table(pa.table(columns), path)
    return path


# --- natural partitions: ids grouped into nodes -------------------------------------------------


def test_group_values_by_hand():
    # ids a..e with 5, 3, 3, 2, 1 samples, 2 nodes; largest first, to the lighter node:
    # a -> n0 (5, 0); b -> n1 (5, 3); c -> n1 (5, 6); d -> n0 (7, 6); e -> n1 (7, 7)
    assert group_values(np.array([5, 3, 3, 2, 1]), 2).tolist() == [0, 1, 1, 0, 1]
    # b (4) -> n0; c (2) -> n1; a (1) -> n1 (2 < 4); renumbered by lowest id: {a, c} is node 0
    assert group_values(np.array([1, 4, 2]), 2).tolist() == [0, 1, 0]
    # equal counts: ids in order round-robin over equally loaded nodes
    assert group_values(np.full(7, 2), 3).tolist() == [0, 1, 2, 0, 1, 2, 0]
    # as many ids as nodes: node i holds id i, whatever the counts
    assert group_values(np.array([1, 9, 4]), 3).tolist() == [0, 1, 2]
    assert group_values(np.array([3, 1]), 1).tolist() == [0, 0]


def test_natural_more_ids_than_nodes_by_hand():
    # ids (sorted) a, b, c, d, e hold 5, 3, 3, 2, 1 samples, as in test_group_values_by_hand
    groups = np.array(list("aaaaabbbcccdde"))
    order = np.random.default_rng(0).permutation(len(groups))
    groups = groups[order]
    parts = partition(np.zeros(len(groups), np.int64), 2, "natural", groups=groups)
    expected = [np.flatnonzero(np.isin(groups, list(ids))) for ids in ("ad", "bce")]
    assert len(parts) == 2
    for got, want in zip(parts, expected):
        np.testing.assert_array_equal(got, want)
    assert [len(p) for p in parts] == [7, 7]
    assert values_per_node(groups, parts) == [2, 3]
    again = partition(np.zeros(len(groups), np.int64), 2, "natural", groups=groups)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))


def test_natural_keeps_every_id_on_one_node():
    rng = np.random.default_rng(5)
    groups = np.array([f"writer-{v:03d}" for v in rng.integers(0, 40, size=700)])
    parts = partition(rng.integers(0, 10, size=700), 6, "natural", groups=groups)
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(700))
    owners = {}
    for node, part in enumerate(parts):
        for value in set(groups[part]):
            assert owners.setdefault(value, node) == node, f"{value} is on two nodes"
    assert len(owners) == len(set(groups))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= max(np.unique(groups, return_counts=True)[1])


def test_natural_fewer_ids_than_nodes_is_one_line():
    groups = np.array(["x", "y", "z", "x", "y", "z"])
    with pytest.raises(UserError) as info:
        partition(np.zeros(6, np.int64), 4, "natural", groups=groups)
    assert str(info.value) == ("the --partition-by column has 3 distinct values, fewer than "
                               "--num-nodes 4: use --num-nodes 3 or fewer")


def test_natural_partition_prints_no_progress_bar(capfd):
    groups = np.array([f"w{i % 9}" for i in range(300)])
    partition(np.arange(300) % 3, 3, "natural", groups=groups)
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out, err)


def test_plan_shows_values_per_node(tmp_path):
    path = digits_with_writers(tmp_path / "d.parquet", writers=13)
    prepared = prepare(RunConfig().replace(dataset=str(path), partitioner="natural",
                                           partition_by="writer", num_nodes=4))
    counts = values_per_node(prepared.data.train.groups, prepared.parts)
    assert sum(counts) == 13 and len(counts) == 4 and min(counts) >= 1
    assert natural_note(prepared) == (
        "13 distinct --partition-by writer values grouped into 4 nodes (each value on one "
        f"node, balanced by samples): {', '.join(map(str, counts))} values per node")
    table = partition_table(prepared)
    assert [c.header for c in table.columns][:3] == ["node", "samples", "values"]
    assert list(table.columns[2].cells) == [str(c) for c in counts]
    one_each = prepare(RunConfig().replace(dataset=str(path), partitioner="natural",
                                           partition_by="writer", num_nodes=13))
    assert natural_note(one_each) is None  # nothing grouped, nothing to say


@pytest.mark.e2e
def test_natural_partition_of_writers_end_to_end(tmp_path, no_leaks):
    data = digits_with_writers(tmp_path / "digits-writers.parquet", writers=13)
    out = tmp_path / "run"
    proc = run_cli("simulate", "--dataset", data, "--partitioner", "natural",
                   "--partition-by", "writer", "--num-nodes", "4", "--rounds", "2",
                   "--output", out)
    note = re.search(r"note: 13 distinct --partition-by writer values grouped into 4 nodes "
                     r"\(each value on one node, balanced by samples\): (\d+), (\d+), (\d+), "
                     r"(\d+) values per node", proc.stdout)
    assert note, proc.stdout
    assert sum(map(int, note.groups())) == 13
    assert "values" in proc.stdout and "4 nodes, natural partition" in proc.stdout
    for bar in ("Generating", "it/s", "Map", "%|"):
        assert bar not in proc.stderr and bar not in proc.stdout, bar
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accuracy"] > 0.5, summary
    notes = json.loads((out / "model.json").read_text())["dataset"]["notes"]
    assert any("values grouped into 4 nodes" in n for n in notes), notes
    fewer = run_cli("simulate", "--dataset", data, "--partitioner", "natural",
                    "--partition-by", "writer", "--num-nodes", "20", check=False)
    assert fewer.returncode == 2
    assert assert_one_error_line(fewer.stderr) == (
        "error: the --partition-by column has 13 distinct values, fewer than --num-nodes 20: "
        "use --num-nodes 13 or fewer")


# --- image folders with empty classes and stray files -------------------------------------------


def image_folder(root, classes=("cat", "dog"), per_class=6, size=8):
    rng = np.random.default_rng(0)
    for name in classes:
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (size, size), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.png")
    return root


def test_image_folder_says_what_it_skipped(tmp_path):
    root = image_folder(tmp_path / "pets")
    (root / "bird").mkdir()  # an empty class folder
    (root / "fish").mkdir()
    (root / "fish" / "readme.txt").write_text("no fish yet")  # a class with no image
    (root / "cat" / "notes.txt").write_text("x")
    (root / "dog" / ".DS_Store").write_bytes(b"\0")
    data = load(str(root))
    assert data.classes == ["cat", "dog"] and len(data.train) + len(data.test) == 12
    assert data.notes[:2] == [
        f"skipped 2 class folder(s) of {root} with no images: bird, fish",
        f"skipped 3 file(s) of {root} that are not images or are hidden: cat/notes.txt, "
        "dog/.DS_Store, fish/readme.txt",
    ]


def test_image_folder_with_more_stray_files_than_images(tmp_path):
    root = image_folder(tmp_path / "pets", per_class=2)
    for name in ("cat", "dog"):
        for i in range(4):
            (root / name / f"caption{i}.txt").write_text("a photo")
    data = load(str(root))  # read as images, not as a text dataset
    assert data.classes == ["cat", "dog"]
    assert data.notes[0].startswith(f"skipped 8 file(s) of {root} that are not images or are "
                                    "hidden: cat/caption0.txt, cat/caption1.txt")
    assert data.notes[0].endswith(" and 3 more")


def test_image_folder_with_split_folders(tmp_path):
    image_folder(tmp_path / "pets" / "train")
    image_folder(tmp_path / "pets" / "test", per_class=2)
    (tmp_path / "pets" / "train" / "bird").mkdir()
    data = load(str(tmp_path / "pets"))
    assert data.classes == ["cat", "dog"] and len(data.test) == 4
    assert data.notes == [f"skipped 1 class folder(s) of {tmp_path / 'pets'} with no images: "
                          "train/bird"]


def test_clean_image_folder_has_no_notes(tmp_path):
    data = load(str(image_folder(tmp_path / "pets")))
    assert not any(n.startswith("skipped") for n in data.notes), data.notes


@pytest.mark.e2e
def test_image_folder_notes_reach_console_and_model_json(tmp_path, no_leaks):
    root = image_folder(tmp_path / "pets", per_class=10)
    (root / "bird").mkdir()
    (root / "cat" / "notes.txt").write_text("x")
    out = tmp_path / "run"
    proc = run_cli("simulate", "--dataset", root, "--num-nodes", "2", "--rounds", "1",
                   "--output", out)
    empty = f"skipped 1 class folder(s) of {root} with no images: bird"
    stray = f"skipped 1 file(s) of {root} that are not images or are hidden: cat/notes.txt"
    assert f"note: {empty}" in proc.stdout and f"note: {stray}" in proc.stdout, proc.stdout
    notes = json.loads((out / "model.json").read_text())["dataset"]["notes"]
    assert notes[:2] == [empty, stray]


# --- library progress bars ----------------------------------------------------------------------


def test_loading_and_partitioning_print_nothing(tmp_path, capfd):
    path = digits_with_writers(tmp_path / "d.parquet", writers=5)
    data = load(str(path), partition_by="writer")
    for scheme in ("iid", "dirichlet", "natural"):
        partition(data.train.y, 5, scheme, groups=data.train.groups)
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out, err)
    from huggingface_hub.utils import are_progress_bars_disabled

    assert are_progress_bars_disabled()  # hub downloads (hub ids) draw no bars either


# --- weights that do not fit, damaged or tampered model files -----------------------------------


def save_model(folder, state=None, meta=None):
    state = build_model("mlp", (1, 8, 8), 10).state_dict() if state is None else state
    return checkpoint.save(folder, state, META if meta is None else meta)


def edit_header(path, change):
    """Rewrite the JSON header of a safetensors file with ``change(header)``."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    change(header)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def _shape(folder):
    sd = build_model("mlp", (1, 8, 8), 10).state_dict()
    sd["1.weight"] = torch.zeros(200, 32)
    save_model(folder, sd)


def _keys(folder):
    sd = build_model("mlp", (1, 8, 8), 10).state_dict()
    sd["head.weight"] = sd.pop("5.weight")
    sd["head.bias"] = sd.pop("5.bias")
    save_model(folder, sd)


def _other_model(folder):  # weights of a 3-class model beside a 10-class description
    save_model(folder, build_model("mlp", (1, 8, 8), 3).state_dict())


def _int_weights(folder):
    sd = build_model("mlp", (1, 8, 8), 10).state_dict()
    sd["3.bias"] = torch.zeros(200, dtype=torch.int32)
    save_model(folder, sd)


def _nan(folder):
    sd = build_model("mlp", (1, 8, 8), 10).state_dict()
    sd["3.weight"][0, 0] = float("nan")
    save_model(folder, sd)


def _truncated(folder):
    save_model(folder)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])


def _empty_file(folder):
    save_model(folder)
    (folder / "model.safetensors").write_bytes(b"")


def _tampered_header(folder):
    save_model(folder)
    edit_header(folder / "model.safetensors", lambda h: h["1.weight"].update(dtype="F64"))


def _huge_header(folder):
    save_model(folder)
    raw = bytearray((folder / "model.safetensors").read_bytes())
    raw[:8] = struct.pack("<Q", 10**12)
    (folder / "model.safetensors").write_bytes(bytes(raw))


def _pickle_file(folder):  # a torch.save file renamed: refused, never unpickled
    save_model(folder)
    torch.save(build_model("mlp", (1, 8, 8), 10).state_dict(), folder / "model.safetensors")


def _json_truncated(folder):
    save_model(folder)
    text = (folder / "model.json").read_text()
    (folder / "model.json").write_text(text[: len(text) // 2])


def _json_other_input(folder):
    save_model(folder, meta={**META, "model": {**META["model"], "input_shape": [1, 28, 28]}})


def _json_unknown_model(folder):
    save_model(folder, meta={**META, "model": {**META["model"], "name": "transformer-xl"}})


def _json_huge_model(folder):  # must not try to allocate 10**12 weights (4 TB)
    save_model(folder, meta={**META, "model": {**META["model"], "args": {"hidden": 10**6}}})


def _json_list(folder):
    save_model(folder)
    (folder / "model.json").write_text("[1, 2, 3]")


DAMAGE = {
    "shape": (_shape, "model.safetensors does not fit the 'mlp' model described in model.json: "
                      "tensor '1.weight' has shape (200, 32), the model expects (200, 64)"),
    "keys": (_keys, "model.safetensors does not fit the 'mlp' model described in model.json: "
                    "lacks 2 tensor(s) the model has: '5.weight', '5.bias'; has 2 tensor(s) "
                    "the model does not: 'head.bias', 'head.weight'"),
    "other-model": (_other_model, "tensor '5.weight' has shape (3, 200), the model expects "
                                  "(10, 200)"),
    "int-weights": (_int_weights, "tensor '3.bias' holds torch.int32 values, the model "
                                  "expects torch.float32"),
    "nan": (_nan, "model.safetensors: tensor '3.weight' holds NaN or infinite values"),
    "truncated": (_truncated, "model.safetensors is not a readable safetensors file"),
    "empty-file": (_empty_file, "model.safetensors is not a readable safetensors file"),
    "tampered-header": (_tampered_header, "model.safetensors is not a readable safetensors "
                                          "file"),
    "huge-header": (_huge_header, "model.safetensors is not a readable safetensors file"),
    "pickle-file": (_pickle_file, "model.safetensors is not a readable safetensors file"),
    "json-truncated": (_json_truncated, "model.json is not valid JSON"),
    "json-other-input": (_json_other_input, "model.json: 'model.input_shape' [1, 28, 28] "
                                            "differs from 'input.shape' [1, 8, 8]; the "
                                            "artifact is damaged"),
    "json-unknown-model": (_json_unknown_model, "model.json: unknown model 'transformer-xl'"),
    "json-huge-model": (_json_huge_model, "tensor '1.weight' has shape (200, 64), the model "
                                          "expects (1000000, 64)"),
    "json-list": (_json_list, "model.json is not a fedavg model description"),
}


# a merge compares the descriptions first: these differ from the good model's
MERGE_FIRST_DIFFERS = {"json-unknown-model", "json-huge-model"}


@pytest.fixture
def cli(tmp_path, monkeypatch):
    """Run the CLI in-process from ``tmp_path``: ``(exit code, stdout, stderr)``."""
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()

    def _run(*args):
        result = runner.invoke(app, [str(a) for a in args])
        assert result.exception is None or isinstance(result.exception, SystemExit), (
            repr(result.exception))
        return result.exit_code, result.stdout, result.stderr

    return _run


@pytest.mark.parametrize("command", ["evaluate", "predict", "merge"])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_model_is_one_line_naming_file_and_problem(tmp_path, cli, damage, command):
    make, expected = DAMAGE[damage]
    bad = tmp_path / "bad"
    make(bad)
    if command == "evaluate":
        args = ["evaluate", bad, "--dataset", "digits"]
    elif command == "predict":
        Image.fromarray(np.zeros((8, 8), np.uint8)).save(tmp_path / "one.png")
        args = ["predict", bad, tmp_path / "one.png"]
    else:
        args = ["merge", save_model(tmp_path / "good"), bad, "--output", tmp_path / "merged"]
    code, _, stderr = cli(*args)
    line = assert_one_error_line(stderr)
    assert code == 2
    if command == "merge" and damage in MERGE_FIRST_DIFFERS:
        expected = f"{bad} differs from {tmp_path / 'good'} in 'model'"
    assert expected in line, line
    assert str(bad) in line  # names the folder of the bad file
    assert not (tmp_path / "merged").exists()


def test_a_good_model_passes_every_command(tmp_path, cli):
    """The damage above is what fails: the same commands work on an intact model."""
    good = save_model(tmp_path / "good")
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(tmp_path / "one.png")
    assert cli("evaluate", good, "--dataset", "digits")[0] == 0
    assert cli("predict", good, tmp_path / "one.png")[0] == 0
    assert cli("merge", good, save_model(tmp_path / "good2"), "--output",
               tmp_path / "merged")[0] == 0


def test_damaged_ensemble_member_is_named(tmp_path):
    from fedavg.use.inference import load_model

    sd = build_model("mlp", (1, 8, 8), 10).state_dict()
    wrong = {k: v.clone() for k, v in sd.items()}
    wrong["1.weight"] = torch.zeros(200, 10)
    checkpoint.save_ensemble(tmp_path, [sd, wrong], [0.5, 0.5], META)
    with pytest.raises(UserError) as info:
        load_model(tmp_path)
    assert str(info.value) == (
        f"{tmp_path}/model.safetensors (ensemble member 1) does not fit the 'mlp' model "
        "described in model.json: tensor '1.weight' has shape (200, 10), the model expects "
        "(200, 64)")


# --- found by tests/test_properties.py ----------------------------------------------------------


def test_infinite_integer_option_is_a_user_error():
    with pytest.raises(UserError, match="--distill-steps expects int, got inf"):
        RunConfig.from_flat({"distill-steps": float("inf")})


def test_pathological_refuses_fewer_than_one_class_per_node():
    with pytest.raises(UserError, match=r"--classes-per-node must be >= 1 \(got 0\)"):
        partition(np.array([0, 1, 0, 1]), 1, "pathological", classes_per_node=0)


def test_refused_merge_leaves_no_runs_folder(tmp_path, cli):
    code, _, stderr = cli("merge", "no-such-model")
    assert code == 2 and "no such model folder: no-such-model" in assert_one_error_line(stderr)
    assert not (tmp_path / "runs").exists()
    (tmp_path / "runs" / "earlier").mkdir(parents=True)  # a runs/ folder in use stays
    assert cli("merge", "no-such-model")[0] == 2
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["earlier"]


def test_text_options_on_image_data_are_noted_not_silently_taken():
    """--tokenizer on digits: the run goes on and says the option does nothing there."""
    prepared = prepare(RunConfig().replace(tokenizer="/no/such/tokenizer.json"), model=False)
    assert "--tokenizer /no/such/tokenizer.json does nothing for image inputs (it tokenizes " \
        "text only)" in prepared.data.notes
    assert not any("--tokenizer" in n for n in prepare(RunConfig(), model=False).data.notes)
