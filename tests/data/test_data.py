"""``fedavg.data.load.load`` on tiny local datasets (no network), and ``input_spec``."""

import io
import math
import re

import datasets
import numpy as np
import pytest
from helpers.cli import MNIST  # ../shared/data, or FEDAVG_SHARED_DATA
from PIL import Image

from fedavg.data.load import LoadedData, Split, load
from fedavg.util.errors import UserError


def png(value: int, size: int = 6, mode: str = "L") -> bytes:
    """PNG bytes of a ``size`` x ``size`` image filled with ``value``."""
    shape = (size, size) if mode == "L" else (size, size, 3)
    buf = io.BytesIO()
    Image.fromarray(np.full(shape, value, dtype=np.uint8), mode=mode).save(buf, format="PNG")
    return buf.getvalue()


def image_dataset(values, labels, **extra) -> datasets.Dataset:
    """Build a Dataset with an ``image`` column (PNG bytes, Image feature) and ``labels``."""
    cols = {"image": [{"bytes": png(v), "path": None} for v in values], "label": list(labels)}
    cols.update(extra)
    return datasets.Dataset.from_dict(cols).cast_column("image", datasets.Image())


def pixel_to_label(data: LoadedData) -> dict[int, str]:
    """Map each sample's (constant) pixel value to its class name, over all splits."""
    seen = {}
    for split in data.splits.values():
        for x, y in zip(split.x, split.y):
            value = int(x.flat[0])
            assert np.all(x == value)
            seen[value] = data.classes[int(y)]
    return seen


# --- digits (built in) -----------------------------------------------------------------------


def test_digits_shapes_classes_and_holdout():
    """Digits load as 8x8 uint8 images over 10 classes, with a 20% test hold-out."""
    data = load("digits", seed=0)
    assert set(data.splits) == {"train", "test"}
    assert data.train.x.dtype == np.uint8 and data.test.x.dtype == np.uint8
    assert data.train.x.shape[1:] == (1, 8, 8) and data.test.x.shape[1:] == (1, 8, 8)
    assert data.input_shape == (1, 8, 8)
    assert data.train.y.dtype == np.int64
    assert data.classes == [str(i) for i in range(10)]
    assert len(data.train) + len(data.test) == 1797
    assert len(data.test) == round(1797 * 0.2)
    assert data.train.x.max() == 255  # 0..16 intensities rescaled to 0..255
    assert len(data.notes) == 1 and "held out" in data.notes[0] and "seed 0" in data.notes[0]


def test_digits_read_without_sklearn_equal_sklearns_load_digits():
    from sklearn.datasets import load_digits

    from fedavg.data.load import digits_arrays

    images, target = digits_arrays()
    bunch = load_digits()
    assert np.array_equal(images, bunch.images) and np.array_equal(target, bunch.target)
    assert list(bunch.target_names) == list(range(10))


def test_digits_holdout_is_seeded():
    """The digits hold-out depends on the seed only."""
    a, b, c = load("digits", seed=0), load("digits", seed=0), load("digits", seed=1)
    np.testing.assert_array_equal(a.test.x, b.test.x)
    np.testing.assert_array_equal(a.train.y, b.train.y)
    assert len(c.test) == len(a.test)
    assert not np.array_equal(a.test.x, c.test.x)


# --- parquet folder laid out like the real MNIST one --------------------------------------------


@pytest.fixture
def parquet_dir(tmp_path):
    """Build a folder of train/test Parquet files like the real MNIST one."""
    root = tmp_path / "pq"
    root.mkdir()
    # pixel value 10 * i identifies sample i; label i % 3
    image_dataset([10 * i for i in range(9)], [i % 3 for i in range(9)]).to_parquet(
        str(root / "train-00000-of-00001.parquet"))
    image_dataset([10 * i + 5 for i in range(4)], [i % 3 for i in range(4)]).to_parquet(
        str(root / "test-00000-of-00001.parquet"))
    return root


def test_parquet_folder(parquet_dir):
    """A Parquet folder gives its train and test splits, each image with its label."""
    data = load(str(parquet_dir))
    assert data.columns == {"image": "image", "label": "label"}
    assert set(data.splits) == {"train", "test"}
    assert data.notes == []  # a real test split: nothing held out
    assert data.train.x.shape == (9, 1, 6, 6) and data.train.x.dtype == np.uint8
    assert data.test.x.shape == (4, 1, 6, 6)
    assert data.classes == ["0", "1", "2"]
    # every image keeps its own label
    for split, offset in ((data.train, 0), (data.test, 5)):
        for x, y in zip(split.x, split.y):
            assert (int(x.flat[0]) - offset) // 10 % 3 == y


def test_parquet_written_by_pyarrow_without_hf_metadata(tmp_path):
    """Image structs without HF metadata are decoded."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    for split, n in (("train", 6), ("test", 3)):
        table = pa.table({
            "image": pa.array([{"bytes": png(10 * i), "path": None} for i in range(n)],
                              type=struct),
            "label": pa.array([i % 3 for i in range(n)], type=pa.int64()),
        })
        pq.write_table(table, str(tmp_path / f"{split}-00000-of-00001.parquet"))
    data = load(str(tmp_path))
    assert data.train.x.shape == (6, 1, 6, 6)
    assert data.test.x.shape == (3, 1, 6, 6)


def test_single_parquet_file_gets_holdout(tmp_path):
    """A single file gets a seeded test hold-out and keeps labels."""
    path = tmp_path / "one.parquet"
    image_dataset([10 * i for i in range(10)], [i % 2 for i in range(10)]).to_parquet(str(path))
    data = load(str(path), seed=3)
    assert len(data.train) == 8 and len(data.test) == 2
    assert data.notes and "held out 2 of 10" in data.notes[0]
    assert pixel_to_label(data) == {10 * i: str(i % 2) for i in range(10)}


# --- save_to_disk, CSV, image folder ----------------------------------------------------------


def test_save_to_disk_datasetdict(tmp_path):
    """A ``save_to_disk`` folder keeps ClassLabel order; validation serves as test."""
    label = datasets.ClassLabel(names=["zebra", "ant", "moose"])
    train = image_dataset([1, 2, 3, 4, 5, 6], [0, 1, 2, 0, 1, 2]).cast_column("label", label)
    val = image_dataset([7, 8], [2, 1]).cast_column("label", label)
    datasets.DatasetDict({"train": train, "validation": val}).save_to_disk(str(tmp_path / "dd"))
    data = load(str(tmp_path / "dd"))
    assert data.classes == ["zebra", "ant", "moose"]  # ClassLabel order, not sorted
    assert set(data.splits) == {"train", "test"}  # validation serves as test
    assert data.notes == []
    assert data.train.x.shape == (6, 1, 6, 6) and data.test.x.shape == (2, 1, 6, 6)
    assert pixel_to_label(data) == {1: "zebra", 2: "ant", 3: "moose", 4: "zebra", 5: "ant",
                                    6: "moose", 7: "moose", 8: "ant"}


def test_a_split_whose_classlabel_lists_other_classes_is_matched_by_name(tmp_path):
    """Each split of a dataset may encode its labels alone (class_encode_column per split)."""
    train = image_dataset([1, 2, 3, 4], [0, 1, 2, 0]).cast_column(
        "label", datasets.ClassLabel(names=["a", "b", "c"]))
    test = image_dataset([7, 8, 9], [0, 1, 1]).cast_column(
        "label", datasets.ClassLabel(names=["c", "b"]))  # index 0 is "c" here, 1 is "b"
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "dd"))
    data = load(str(tmp_path / "dd"))
    assert data.classes == ["a", "b", "c"]
    assert pixel_to_label(data) == {1: "a", 2: "b", 3: "c", 4: "a", 7: "c", 8: "b", 9: "b"}
    odd = image_dataset([7], [0]).cast_column("label", datasets.ClassLabel(names=["fox"]))
    datasets.DatasetDict({"train": train, "test": odd}).save_to_disk(str(tmp_path / "fox"))
    with pytest.raises(UserError, match="split 'test' has label 'fox' that train does not have"):
        load(str(tmp_path / "fox"))
    # train of raw values (here ints), a split encoded apart: its names are those values
    raw = image_dataset([1, 2], [5, 6])
    datasets.DatasetDict({"train": raw, "test": image_dataset([7], [0]).cast_column(
        "label", datasets.ClassLabel(names=["6"]))}).save_to_disk(str(tmp_path / "raw"))
    data = load(str(tmp_path / "raw"))
    assert data.classes == ["5", "6"] and list(data.test.y) == [1]


def test_whole_float_labels_are_the_classes_integer_labels_name(tmp_path):
    """0.0 / 1.0 labels are the classes "0" / "1", and "1.0" matches "1" in another table."""
    from fedavg.data.load import conform

    path = tmp_path / "f.csv"
    path.write_text("a,label\n" + "".join(f"{i},{float(i % 3)}\n" for i in range(9)))
    data = load(str(path), seed=0)
    assert data.classes == ["0", "1", "2"]
    for split in data.splits.values():
        assert all(int(x[0]) % 3 == y for x, y in zip(split.x, split.y))
    # a model saved with the classes "1.0", "2.0" (before this rule) reads a table of "2"s
    part = conform(Split(np.zeros((2, 1), np.float32), np.array([0, 0])), "t.csv", (1,),
                   ["2"], ["1.0", "2.0"])
    assert part.y.tolist() == [1, 1]
    path.write_text("a,label\n1,1.0\n2,inf\n3,0.0\n")
    with pytest.raises(UserError, match="label column 'label' holds infinite values"):
        load(str(path))
    with pytest.raises(UserError, match=r"labels the model does not know: \['3'\] \(model "
                                        r"classes: 1.0, 2.0\)$"):
        conform(Split(np.zeros((1, 1), np.float32), np.array([0])), "t.csv", (1,),
                ["3"], ["1.0", "2.0"])
    with pytest.raises(UserError, match=r"labels the model does not know: \['0', '1'\] \(model "
                                        r"classes: world, sports\); write the labels as these "
                                        r"class names$"):  # indices for a model of names
        conform(Split(np.zeros((2, 1), np.float32), np.array([0, 1])), "t.csv", (1,),
                ["0", "1"], ["world", "sports"])


def test_csv_tabular(tmp_path):
    """A CSV table gives float32 features and sorted string classes."""
    names = ["pear", "apple", "fig"]
    rows = ["f1,f2,f3,label"] + [f"{i},{i * 0.5},{-i},{names[i % 3]}" for i in range(12)]
    path = tmp_path / "table.csv"
    path.write_text("\n".join(rows) + "\n")
    data = load(str(path), seed=0)
    assert data.classes == ["apple", "fig", "pear"]  # sorted label strings
    assert data.columns == {"features": ["f1", "f2", "f3"], "label": "label"}
    assert data.train.x.dtype == np.float32 and data.train.x.ndim == 2
    assert data.input_shape == (3,)
    assert len(data.train) + len(data.test) == 12 and len(data.test) == round(12 * 0.2)
    for split in data.splits.values():
        for x, y in zip(split.x, split.y):
            i = int(x[0])
            np.testing.assert_allclose(x, [i, i * 0.5, -i])
            assert data.classes[y] == names[i % 3]


def test_csv_with_a_pandas_row_index_leaves_it_out(tmp_path):
    """Row numbers from ``df.to_csv(path)`` (index kept) are no features.

    Read back and saved again, both indexes are left out; a named id column and a saved
    model's features stay as given.
    """
    import pandas as pd

    frame = pd.DataFrame({"f1": [0.5 * i for i in range(10)], "f2": [-i for i in range(10)],
                          "label": ["ab"[i % 2] for i in range(10)]})
    frame.index = frame.index * 3 + 1  # row numbers that are no feature
    frame.to_csv(tmp_path / "once.csv")
    pd.read_csv(tmp_path / "once.csv").to_csv(tmp_path / "twice.csv")
    frame.rename_axis("row_id").to_csv(tmp_path / "named.csv")
    for name, index in (("once", ["Unnamed: 0"]), ("twice", ["Unnamed: 0.1", "Unnamed: 0"])):
        data = load(str(tmp_path / f"{name}.csv"), seed=0)
        assert data.columns["features"] == ["f1", "f2"], name
        assert data.input_shape == (2,)
        assert any(f"left out {', '.join(map(repr, index))}: row numbers" in n
                   for n in data.notes), data.notes
        x = np.concatenate([data.train.x, data.test.x])[:, 0]
        assert sorted(x.tolist()) == [0.5 * i for i in range(10)]
    named = load(str(tmp_path / "named.csv"), seed=0)
    assert named.columns["features"] == ["row_id", "f1", "f2"]  # the user named it: a feature
    assert not any("left out" in n for n in named.notes), named.notes
    saved = load(str(tmp_path / "once.csv"), feature_columns=["Unnamed: 0", "f1"],
                 label_hint="label")
    assert saved.columns["features"] == ["Unnamed: 0", "f1"]  # a model trained on it keeps it
    only = tmp_path / "only.csv"
    only.write_text(",label\n0,a\n1,b\n2,a\n3,b\n4,a\n")
    assert load(str(only), seed=0).columns["image"] == "Unnamed: 0"  # nothing else: kept


def test_image_folder(tmp_path):
    """An image folder gives one class per subfolder."""
    root = tmp_path / "imgs"
    values = {"cat": 40, "dog": 200}
    for cls, value in values.items():
        (root / cls).mkdir(parents=True)
        for k in range(4):
            (root / cls / f"{k}.png").write_bytes(png(value + k, mode="RGB"))
    data = load(str(root))
    assert data.classes == ["cat", "dog"]
    assert data.train.x.shape[1:] == (3, 6, 6) and data.train.x.dtype == np.uint8
    assert len(data.train) + len(data.test) == 8
    seen = pixel_to_label(data)
    assert seen == {40 + k: "cat" for k in range(4)} | {200 + k: "dog" for k in range(4)}


def test_image_folder_labels_come_from_class_folders_and_splits_from_split_folders(tmp_path):
    """File names never make splits, sub-folders stay in their class, split folders in any case.

    (``datasets``' own builder read ``test_0.png`` / ``scan_val_1.png`` as splits and dropped
    the other images, and labelled ``zero/session1/a.png`` as ``session1``.)
    """
    root = tmp_path / "imgs"
    value = iter(range(1, 250))
    expected = {}
    for split in ("Train", "Test"):
        for cls in ("zero", "one"):
            for name in ("test_0.png", "scan_val_1.png", "img2.png", "session1/a.png",
                         "session2/deep/b.png"):
                f = root / split / cls / name
                f.parent.mkdir(parents=True, exist_ok=True)
                v = next(value)
                f.write_bytes(png(v))
                expected[v] = (split, cls)
    data = load(str(root))
    assert data.classes == ["one", "zero"]
    assert len(data.train) == len(data.test) == 10  # Test/ is the test split, nothing dropped
    assert pixel_to_label(data) == {v: cls for v, (_, cls) in expected.items()}
    assert {int(x.flat[0]) for x in data.test.x} == {v for v, (s, _) in expected.items()
                                                     if s == "Test"}
    assert not any("held out" in n for n in data.notes)


def test_image_folder_labelled_by_metadata_tables(tmp_path):
    """``metadata.csv`` / ``.jsonl`` label the images; file names never make splits.

    (``datasets``' own builder took ``test_*.png`` as a test split, and then neither split
    had a label column.)
    """
    import json

    root = tmp_path / "imgs"
    root.mkdir()
    expected, lines = {}, ["file_name,label,note"]
    for v in range(1, 21):
        name = f"{'test_' if v % 4 == 0 else 'img'}{v}.png"
        (root / name).write_bytes(png(v))
        expected[v] = "even" if v % 2 == 0 else "odd"
        lines.append(f"{name},{expected[v]},n{v}")
    (root / "metadata.csv").write_text("\n".join(lines) + "\n")
    (root / "figure.png").write_bytes(png(250))  # listed nowhere: skipped with a note
    data = load(str(root))
    assert data.classes == ["even", "odd"] and data.columns["label"] == "label"
    assert len(data.train) + len(data.test) == 20  # every listed image, a 20 % hold-out
    assert pixel_to_label(data) == expected
    assert f"skipped 1 image(s) of {root} that no metadata table lists: figure.png" in data.notes

    split = tmp_path / "split"  # a table per split folder, and one naming test/ images
    for name, values in (("train", range(1, 9)), ("test", range(9, 13))):
        (split / name / "pics").mkdir(parents=True)
        rows = []
        for v in values:
            (split / name / "pics" / f"{v}.png").write_bytes(png(v))
            rows.append({"file_name": f"pics/{v}.png", "label": v % 3})
        if name == "train":
            (split / name / "metadata.jsonl").write_text(
                "".join(json.dumps(r) + "\n" for r in rows))
        else:  # at the root, its paths under test/
            (split / "metadata.jsonl").write_text("".join(
                json.dumps({**r, "file_name": f"test/{r['file_name']}"}) + "\n" for r in rows))
    data = load(str(split))
    assert len(data.train) == 8 and len(data.test) == 4
    assert {int(x.flat[0]) for x in data.test.x} == set(range(9, 13))
    assert pixel_to_label(data) == {v: str(v % 3) for v in range(1, 13)}


@pytest.mark.parametrize("text, words", [
    ("name,label\na.png,x\n", "has no file_name column (each image's path relative to it; "
                              "columns: name, label)"),
    ("file_name,label\na.png,x\nb.png,y\nsub/c.png,y\n",
     "names 2 image(s) that are not there: b.png, sub/c.png; fix its file_name column"),
    ("file_name,image,label\na.png,7,x\n", "has an image column beside file_name: the images "
                                           "go there; rename that column"),
])
def test_image_folder_metadata_mistakes_are_one_line(tmp_path, text, words):
    root = tmp_path / "imgs"
    root.mkdir()
    (root / "a.png").write_bytes(png(1))
    (root / "metadata.csv").write_text(text)
    with pytest.raises(UserError, match=re.escape(f"{root}: metadata.csv {words}")):
        load(str(root))


def test_images_beside_a_table_that_is_no_metadata_table_say_how_to_label_them(tmp_path):
    root = tmp_path / "kaggle"
    (root / "images").mkdir(parents=True)
    rows = ["id,label"]
    for i in range(6):
        (root / "images" / f"{i}.png").write_bytes(png(i))
        rows.append(f"{i},{i % 2}")
    (root / "labels.csv").write_text("\n".join(rows) + "\n")
    with pytest.raises(UserError, match=re.escape(
            f"{root} holds images and tables (labels.csv) but no labels of the images: to "
            "label them by a table, name it metadata.csv with a file_name column")):
        load(str(root))


def test_image_folder_images_outside_class_folders_and_linked_class_folders(tmp_path):
    root = tmp_path / "imgs"
    for cls, v in (("a", 10), ("b", 20)):
        (root / cls).mkdir(parents=True)
        for k in range(3):
            (root / cls / f"{k}.png").write_bytes(png(v + k))
    elsewhere = tmp_path / "more_c"
    elsewhere.mkdir()
    for k in range(3):
        (elsewhere / f"{k}.png").write_bytes(png(30 + k))
    (root / "c").symlink_to(elsewhere, target_is_directory=True)
    (root / "preview.png").write_bytes(png(99))  # not in a class folder
    data = load(str(root))
    assert data.classes == ["a", "b", "c"]
    assert pixel_to_label(data) == {10 + k: "a" for k in range(3)} | {
        20 + k: "b" for k in range(3)} | {30 + k: "c" for k in range(3)}
    assert f"skipped 1 image(s) of {root} outside class folders: preview.png" in data.notes
    (root / "test" / "a").mkdir(parents=True)  # a split folder beside the class folders
    (root / "test" / "a" / "t.png").write_bytes(png(5))
    with pytest.raises(UserError, match=r"holds split folders \(test\) beside class folders "
                                        r"\(a, b, c\): move the class folders into a train/"):
        load(str(root))
    loose = tmp_path / "loose"
    loose.mkdir()
    (loose / "x.png").write_bytes(png(1))
    with pytest.raises(UserError, match=r"holds images but no class folders: put each class's "
                                        r"images in a folder named after it \(x.png"):
        load(str(loose))


def test_image_bytes_without_image_metadata_are_the_input_not_an_id_column(tmp_path):
    """``{bytes, path}`` structs and raw bytes (pyarrow, no metadata) are images, by any name."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    values = [10, 20, 30, 40]
    for name, cells in (("photo", [{"bytes": png(v), "path": None} for v in values]),
                        ("image", [png(v) for v in values])):
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.table({"id": [0, 1, 2, 3], name: cells, "label": ["a", "b"] * 2}),
                       str(path))
        data = load(str(path), seed=0)
        assert data.columns == {"image": name, "label": "label"}
        assert data.train.x.shape[1:] == (1, 6, 6)
        assert pixel_to_label(data) == {10: "a", 20: "b", 30: "a", 40: "b"}
    # raw bytes by another name (a digest) beside numbers: a table; named, images
    pq.write_table(pa.table({"digest": [png(v) for v in values], "f1": [1.0, 2.0, 3.0, 4.0],
                             "f2": [0.0] * 4, "label": ["a", "b"] * 2}),
                   str(tmp_path / "t.parquet"))
    assert load(str(tmp_path / "t.parquet")).columns == {"features": ["f1", "f2"],
                                                         "label": "label"}
    named = load(str(tmp_path / "t.parquet"), image_column="digest", seed=0)
    assert named.train.x.shape[1:] == (1, 6, 6)


# --- column overrides and detection errors ----------------------------------------------------


@pytest.fixture
def two_columns(tmp_path):
    """Parquet file with two image columns and two label-like columns."""
    ds = datasets.Dataset.from_dict({
        "image": [{"bytes": png(10), "path": None}] * 4,
        "alt": [{"bytes": png(20 * i, size=4), "path": None} for i in range(4)],
        "label": ["a", "b", "a", "b"],
        "target": [3, 1, 2, 0],
    }).cast_column("image", datasets.Image()).cast_column("alt", datasets.Image())
    path = tmp_path / "two.parquet"
    ds.to_parquet(str(path))
    return path


def test_column_detection_default(two_columns):
    """The ``image`` and ``label`` columns are detected."""
    data = load(str(two_columns))
    assert data.columns == {"image": "image", "label": "label"}
    assert data.classes == ["a", "b"]
    assert data.input_shape == (1, 6, 6)


def test_column_overrides(two_columns):
    """Named columns override detection."""
    data = load(str(two_columns), image_column="alt", label_column="target")
    assert data.columns == {"image": "alt", "label": "target"}
    assert data.classes == ["0", "1", "2", "3"]
    assert data.input_shape == (1, 4, 4)
    # alt pixel 20*i goes with target [3, 1, 2, 0][i]
    assert pixel_to_label(data) == {0: "3", 20: "1", 40: "2", 60: "0"}


@pytest.mark.parametrize("kwargs,flag", [({"label_column": "nope"}, "--label-column"),
                                         ({"image_column": "nope"}, "--image-column")])
def test_wrong_column_name(two_columns, kwargs, flag):
    """A wrong column name is a user error naming the flag and listing columns."""
    with pytest.raises(UserError) as info:
        load(str(two_columns), **kwargs)
    msg = str(info.value)
    assert "'nope'" in msg and flag in msg
    for col in ("image", "alt", "label", "target"):
        assert col in msg.split("columns are:")[1]


def test_no_label_column(tmp_path):
    """No detectable label column is a user error asking for ``--label-column``."""
    ds = datasets.Dataset.from_dict({"pic": [{"bytes": png(i), "path": None} for i in range(3)],
                                     "kind": [0, 1, 0]}).cast_column("pic", datasets.Image())
    ds.to_parquet(str(tmp_path / "nolabel.parquet"))
    with pytest.raises(UserError, match="no label column") as info:
        load(str(tmp_path / "nolabel.parquet"))
    assert "--label-column" in str(info.value) and "pic, kind" in str(info.value)
    # naming it explicitly works
    data = load(str(tmp_path / "nolabel.parquet"), label_column="kind")
    assert data.columns == {"image": "pic", "label": "kind"}


def test_the_only_input_column_taken_as_the_label_is_named(tmp_path):
    labels = datasets.ClassLabel(names=["world", "sports"])  # as AG News stores them
    ds = datasets.Dataset.from_dict({"text": [f"some words {i}" for i in range(6)],
                                     "label": [i % 2 for i in range(6)]},
                                    features=datasets.Features({"text": datasets.Value("string"),
                                                                "label": labels}))
    ds.to_parquet(str(tmp_path / "news.parquet"))
    with pytest.raises(UserError, match="besides the label column 'text'; pass --image-column "
                                        "or --text-column, or another --label-column"):
        load(str(tmp_path / "news.parquet"), label_column="text")
    # or as the column of natural node ids
    with pytest.raises(UserError, match="besides the label column 'label' and the "
                                        "--partition-by column 'text'; pass --image-column or "
                                        "--text-column, or another --label-column or "
                                        "--partition-by"):
        load(str(tmp_path / "news.parquet"), partition_by="text")


def test_missing_path(tmp_path, monkeypatch):
    """A path that does not exist is a user error."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="no such file or folder: ./nope"):
        load("./nope")


def test_unsupported_suffix(tmp_path):
    """An unsupported file type is a user error."""
    path = tmp_path / "data.xlsx"
    path.write_bytes(b"not a spreadsheet")
    with pytest.raises(UserError, match=r"cannot read .*data\.xlsx"):
        load(str(path))


# --- input_spec ---------------------------------------------------------------------------------


def spec_of(x: np.ndarray) -> dict:
    """Return the input spec of a one-class dataset with train inputs ``x``."""
    return LoadedData({"train": Split(x, np.zeros(len(x), np.int64))}, ["a"], "t").input_spec()


def test_input_spec_one_channel_by_hand():
    """One-channel mean and std match a hand computation."""
    x = np.array([[[[0, 255], [255, 0]]], [[[51, 102], [153, 204]]]], dtype=np.uint8)
    spec = spec_of(x)
    # scaled values: 0 1 1 0 0.2 0.4 0.6 0.8 -> mean 4/8 = 0.5
    # mean of squares (0+1+1+0+0.04+0.16+0.36+0.64)/8 = 0.4 -> var 0.4 - 0.25 = 0.15
    assert spec["shape"] == [1, 2, 2] and spec["dtype"] == "uint8"
    assert spec["scale"] == pytest.approx(1 / 255)
    assert spec["mean"] == pytest.approx([0.5], abs=1e-6)
    assert spec["std"] == pytest.approx([math.sqrt(0.15)], abs=1e-6)


def test_input_spec_per_channel_and_constant_channel():
    """Statistics are per channel; a constant channel gets std 1."""
    # channel 0: 0 255 | 255 0 -> mean 0.5, std 0.5; channel 1 constant 0.2 -> std 0 -> 1.0
    x = np.array([[[[0, 255]], [[51, 51]]], [[[255, 0]], [[51, 51]]]], dtype=np.uint8)
    spec = spec_of(x)
    assert spec["shape"] == [2, 1, 2]
    assert spec["mean"] == pytest.approx([0.5, 0.2], abs=1e-6)
    assert spec["std"] == pytest.approx([0.5, 1.0], abs=1e-6)


def test_input_spec_tabular():
    """Tabular statistics are per feature; a constant feature gets std 1."""
    spec = spec_of(np.array([[1.0, 10.0], [3.0, 10.0]], dtype=np.float32))
    assert spec["shape"] == [2] and spec["dtype"] == "float32" and spec["scale"] == 1.0
    assert spec["mean"] == pytest.approx([2.0, 10.0])
    assert spec["std"] == pytest.approx([1.0, 1.0])  # feature 1 is constant -> 1.0


# --- the real MNIST copy ------------------------------------------------------------------------


def test_real_mnist():
    """The real MNIST copy loads with its 60000/10000 splits."""
    data = load(str(MNIST))
    assert len(data.train) == 60000 and len(data.test) == 10000
    assert data.input_shape == (1, 28, 28) and data.train.x.dtype == np.uint8
    assert data.classes == [str(i) for i in range(10)]
    assert data.columns == {"image": "image", "label": "label"}
    assert int(np.sum(data.train.y == 0)) == 5923
    assert data.notes == []


def test_unreadable_files_say_what_is_wrong_in_one_line(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(UserError, match=r"empty.csv is an empty file: give a data file"):
        load(str(empty))
    (tmp_path / "header.csv").write_text("a,b,label\n")
    with pytest.raises(UserError, match=r"cannot read dataset at \S+header.csv: it holds no "
                                        r"rows$"):
        load(str(tmp_path / "header.csv"))
    folder = tmp_path / "splits"
    folder.mkdir()
    (folder / "train.csv").write_text("a,b,label\n1,2,0\n3,4,1\n5,6,0\n7,8,1\n")
    (folder / "test.csv").write_text("a,b,target\n1,2,0\n3,4,1\n")
    with pytest.raises(UserError) as info:  # not datasets' generic first line
        load(str(folder))
    message = str(info.value)
    assert "must have the same columns" in message and "'target'" in message
    assert "\n" not in message


# --- a saved model's columns -------------------------------------------------------------------


def _tabular_meta(data, source):
    return {"input": data.input_spec(), "classes": data.classes,
            "dataset": {"source": source, "columns": data.columns, "seed": 0,
                        "test_fraction": 0.2}}


def test_an_image_dataset_the_model_never_saw_is_scored_and_predicted_whole(tmp_path):
    """One split of data other than the run's: every row, in order, not a 20 % hold-out."""
    from fedavg.use.inference import _dataset_batch, evaluation_data

    run_data = image_dataset([1, 2, 3, 4, 5], ["a", "b", "a", "b", "a"])
    run_data.to_parquet(str(tmp_path / "run.parquet"))
    meta = _tabular_meta(load(str(tmp_path / "run.parquet")), str(tmp_path / "run.parquet"))
    image_dataset(list(range(10, 20)), ["a", "b"] * 5).to_parquet(str(tmp_path / "new.parquet"))
    x, names = _dataset_batch(str(tmp_path / "new.parquet"), "test", meta, print)
    assert names == [f"{tmp_path / 'new.parquet'}#row{i}" for i in range(10)]
    assert [int(v.flat[0]) for v in x] == list(range(10, 20))
    _, _, _, part = evaluation_data(meta, tmp_path, str(tmp_path / "new.parquet"))
    assert len(part) == 10 and part.y.tolist() == [0, 1] * 5
    # the run's own data keeps the run's hold-out: what was not trained on
    _, own, _, part = evaluation_data(meta, tmp_path, str(tmp_path / "run.parquet"))
    assert len(part) == 1 and own.test is not own.train


def test_the_label_column_is_the_most_usual_name_and_scalars_are_features(tmp_path):
    """``x`` and ``y`` are usual input and label names, but ``label`` says more."""
    rows = ["x,y,z,label"] + [f"{i % 7},{i % 3},{i * 0.5},{'ab'[i % 2]}" for i in range(20)]
    (tmp_path / "xy.csv").write_text("\n".join(rows) + "\n")
    data = load(str(tmp_path / "xy.csv"))
    assert data.columns == {"features": ["x", "y", "z"], "label": "label"}
    assert data.classes == ["a", "b"] and data.train.x.shape[1:] == (3,)


def test_a_saved_tabular_model_reads_its_own_columns_by_name(tmp_path, monkeypatch):
    """The run's label and features, however the file is named or its columns ordered."""
    from fedavg.use.inference import evaluation_data

    rows = ["f1,f2,class,grade,site"] + [
        f"{i},{-i},{(i * 7) % 2},{'lo' if i < 10 else 'hi'},{i % 3}" for i in range(20)]
    (tmp_path / "grade.csv").write_text("\n".join(rows) + "\n")
    data = load(str(tmp_path / "grade.csv"), label_column="grade", partition_by="site")
    # site is the partition column and class another column: the features are f1, f2, class
    assert data.columns == {"features": ["f1", "f2", "class"], "label": "grade"}
    meta = _tabular_meta(data, str(tmp_path / "grade.csv"))
    monkeypatch.chdir(tmp_path)
    _, _, _, part = evaluation_data(meta, tmp_path, "grade.csv")  # the same file, relative
    assert np.array_equal(part.y, data.test.y) and np.array_equal(part.x, data.test.x)
    # another file: features (and the label) taken by name, whatever their order
    header = ["class", "site", "grade", "f2", "f1"]
    table = [dict(zip(rows[0].split(","), line.split(","))) for line in rows[1:]]
    (tmp_path / "other.csv").write_text("\n".join(
        [",".join(header)] + [",".join(r[c] for c in header) for r in table]) + "\n")
    # data the model never trained on, without a test split: scored whole, rows in order
    whole = load(str(tmp_path / "grade.csv"), label_column="grade", partition_by="site",
                 hold_out=False)
    assert whole.test is whole.train and len(whole.test) == 20
    for split in ("test", "train"):
        _, _, _, part = evaluation_data(meta, tmp_path, "other.csv", split=split)
        assert np.array_equal(part.x, whole.test.x) and np.array_equal(part.y, whole.test.y)
    assert part.x[:, 0].tolist() == list(range(20))
    (tmp_path / "less.csv").write_text("f1,grade\n1,lo\n2,hi\n3,lo\n")
    with pytest.raises(UserError, match="less.csv lacks the feature column.s. f2, class that "
                                        "the model takes .f1, f2, class."):
        evaluation_data(meta, tmp_path, "less.csv")


def test_a_corrupt_image_in_a_folder_is_named_by_its_file(tmp_path):
    for cls in ("cat", "dog"):
        (tmp_path / "pics" / cls).mkdir(parents=True)
        for i in range(3):
            (tmp_path / "pics" / cls / f"{i}.png").write_bytes(png(10 * i))
    bad = tmp_path / "pics" / "dog" / "1.png"
    bad.write_bytes(png(5)[:40])  # a truncated PNG
    with pytest.raises(UserError, match=f"cannot decode image {bad} of "):
        load(str(tmp_path / "pics"))


def test_predict_on_a_table_takes_every_row_by_feature_name_without_labels(tmp_path):
    """A tabular model predicts a whole table, labelled or not, its columns in any order."""
    from fedavg.models.registry import build_model
    from fedavg.run import checkpoint
    from fedavg.use.inference import predict

    rows = ["f1,f2,label"] + [f"{i},{-i},{'ab'[i % 2]}" for i in range(20)]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    data = load(str(tmp_path / "t.csv"))
    meta = {**_tabular_meta(data, str(tmp_path / "t.csv")),
            "model": {"name": "mlp", "input_shape": [2], "num_classes": 2, "args": {}}}
    checkpoint.save(tmp_path / "run", build_model("mlp", (2,), 2).state_dict(), meta)
    (tmp_path / "new.csv").write_text(
        "\n".join(["f2,extra,f1"] + [f"{-i},x,{i}" for i in range(7)]) + "\n")  # no label
    for table, n in ((tmp_path / "t.csv", 20), (tmp_path / "new.csv", 7)):
        got = predict(tmp_path / "run", [str(table)])
        assert [r["input"] for r in got] == [f"{table}#row{i}" for i in range(n)]
    # the same rows in both, the features matched by name: the same predictions
    first = predict(tmp_path / "run", [str(tmp_path / "t.csv")])[:7]
    second = predict(tmp_path / "run", [str(tmp_path / "new.csv")])
    assert [r["prediction"] for r in first] == [r["prediction"] for r in second]
    # rounded to 6 decimals from batches of 20 and 7 rows: the last decimal may differ by 1
    assert [r["confidence"] for r in first] == pytest.approx([r["confidence"] for r in second],
                                                             abs=2e-6)


def test_a_stray_string_in_a_column_of_numbers_is_refused_not_read_as_text(tmp_path):
    rows = ["a,b,label"] + [f"{i},{'?' if i == 3 else i * 2},{'xy'[i % 2]}" for i in range(30)]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    with pytest.raises(UserError, match=r"column 'b' of \S+t.csv holds numbers but also 1 other "
                                        r"value\(s\) such as '\?', so it reads as text: fix or "
                                        r"drop the values that are not numbers, or pass "
                                        r"--text-column b if it is text"):
        load(str(tmp_path / "t.csv"))
    assert load(str(tmp_path / "t.csv"), text_column="b").kind == "text"  # named: as asked
    words = ["a,b,label"] + [f"{i},word{i} here,{'xy'[i % 2]}" for i in range(30)]
    (tmp_path / "w.csv").write_text("\n".join(words) + "\n")
    assert load(str(tmp_path / "w.csv")).kind == "text"  # real text is text
    # a table with a category column: its numbers are the features, the category is noted
    rows = ["a,city,b,label"] + [f"{i},{['Oslo', 'Rome', 'Lima'][i % 3]},{i * 2},{'xy'[i % 2]}"
                                  for i in range(30)]
    (tmp_path / "c.csv").write_text("\n".join(rows) + "\n")
    data = load(str(tmp_path / "c.csv"))
    assert data.kind == "tabular" and data.columns == {"features": ["a", "b"], "label": "label"}
    assert "string column(s) city left out: short values (categories, ids, dates) are not " \
        "features a table encodes (--text-column to train on one as text)" in data.notes
    assert load(str(tmp_path / "c.csv"), text_column="city").kind == "text"


def test_ids_and_dates_beside_numbers_are_left_out_not_taken_as_text(tmp_path):
    """One-word strings (ids, dates) are no text: the numbers are the features, and said so.

    (A unique id column made a text model of the table, its numbers ignored.)
    """
    import pandas as pd

    n = 40
    frame = pd.DataFrame({"customer_id": [f"C{i:05d}" for i in range(n)],
                          "f1": [float(i) for i in range(n)], "f2": [i % 7 for i in range(n)],
                          "when": pd.date_range("2020-01-01", periods=n),
                          "label": ["ab"[i % 2] for i in range(n)]})
    frame.assign(when=frame["when"].dt.strftime("%Y-%m-%d")).to_csv(tmp_path / "t.csv",
                                                                      index=False)
    data = load(str(tmp_path / "t.csv"), seed=0)
    assert data.kind == "tabular" and data.columns["features"] == ["f1", "f2"]
    assert "string column(s) customer_id, when left out: short values (categories, ids, " \
        "dates) are not features a table encodes (--text-column to train on one as text)" \
        in data.notes
    frame.to_parquet(tmp_path / "t.parquet")  # a real timestamp column: named, left out
    data = load(str(tmp_path / "t.parquet"), seed=0)
    assert data.columns["features"] == ["f1", "f2"]
    assert any(n.startswith("column(s) when (timestamp") and "left out: a table's features are "
               "numbers" in n for n in data.notes), data.notes
    frame.assign(review=[f"the {i}th was {'good' if i % 2 else 'bad'} today" for i in
                         range(n)]).to_csv(tmp_path / "r.csv", index=False)
    data = load(str(tmp_path / "r.csv"), seed=0)  # an id column first, then real text
    assert data.kind == "text" and data.columns["text"] == "review"
    assert "numeric column(s) f1, f2 left out: a text model reads its text ('review') only" \
        in data.notes


def test_labels_that_differ_only_in_case_or_spaces_are_noted(tmp_path):
    rows = ["a,label"] + [f"{i},{['neg', 'neg ', 'pos'][i % 3]}" for i in range(30)]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    data = load(str(tmp_path / "t.csv"))
    assert data.classes == ["neg", "neg ", "pos"]
    assert "label values that differ only in case, spaces or how a number is written are " \
        "separate classes: 'neg', 'neg '" in data.notes
    assert not any("differ only" in n for n in load("digits").notes)
    rows = ["a,label"] + [f"{i},{['1', '1.0', 'x'][i % 3]}" for i in range(30)]  # text labels
    (tmp_path / "n.csv").write_text("\n".join(rows) + "\n")
    assert "label values that differ only in case, spaces or how a number is written are " \
        "separate classes: '1', '1.0'" in load(str(tmp_path / "n.csv")).notes


def test_a_saved_tabular_model_on_other_tables_label_hint_and_stray_strings(tmp_path):
    from fedavg.use.inference import evaluation_data
    from fedavg.use.inputs import table_rows

    rows = ["f1,f2,grade"] + [f"{i},{-i},{'lo' if i < 10 else 'hi'}" for i in range(20)]
    (tmp_path / "g.csv").write_text("\n".join(rows) + "\n")
    data = load(str(tmp_path / "g.csv"), label_column="grade")
    meta = _tabular_meta(data, str(tmp_path / "g.csv"))
    # another table whose label goes by another name: detected, as before
    (tmp_path / "t.csv").write_text("\n".join(r.replace("grade", "target") for r in rows) + "\n")
    _, _, _, part = evaluation_data(meta, tmp_path, str(tmp_path / "t.csv"))
    assert part.y.tolist() == [1] * 10 + [0] * 10  # all 20 rows, in order ("hi" is class 0)
    # a "?" among a feature's numbers: one line, not a traceback, in evaluate and predict
    bad = rows[:5] + ["5,?,lo"] + rows[6:]
    (tmp_path / "bad.csv").write_text("\n".join(bad) + "\n")
    for call in (lambda: evaluation_data(meta, tmp_path, str(tmp_path / "bad.csv")),
                 lambda: table_rows(str(tmp_path / "bad.csv"), ["f1", "f2"])):
        with pytest.raises(UserError, match=r"column\(s\) f2 of \S+bad.csv do not hold numbers "
                                            r"only \(f2 reads as text\), but the model takes "
                                            r"them as numeric features"):
            call()


def test_reading_a_wide_table_touches_its_schema_as_often_as_a_narrow_one(tmp_path, monkeypatch):
    """The loader reads the schema a fixed number of times, not once per column.

    ``Dataset.features`` deep-copies it on every access (2.7 s at 3,000 columns): once per
    column made a 500-column table take a minute to load.
    """
    reads = []
    original = datasets.Dataset.features.fget
    monkeypatch.setattr(datasets.Dataset, "features",
                        property(lambda self: reads.append(1) or original(self)))
    counts = []
    for width in (3, 60):
        path = tmp_path / f"w{width}.csv"
        path.write_text(",".join(f"f{i}" for i in range(width)) + ",label\n" + "".join(
            ",".join(str(r + i) for i in range(width)) + f",{r % 2}\n" for r in range(20)))
        reads.clear()
        assert load(str(path)).train.x.shape[1] == width
        counts.append(len(reads))
    assert counts[0] == counts[1], counts


def test_image_files_for_a_model_trained_on_float_arrays_take_its_range(tmp_path):
    """Pixel arrays of 0..255 floats: images are given as 0..255, not divided by 255."""
    from fedavg.use.inference import _image_batch

    path = tmp_path / "a.png"
    path.write_bytes(png(200))
    # 0..255 digits; 0..1 ones; 0/1 pixels, mostly 1 (std 0.46: mean + 3 std over 2)
    for mean, std, want in ((33.0, 78.0, 200.0), (0.13, 0.3, 200 / 255), (0.7, 0.46, 200 / 255)):
        meta = {"input": {"kind": "image", "shape": [1, 6, 6], "dtype": "float32",
                          "scale": 1.0, "mean": [mean], "std": [std]}}
        notes = []
        x, names = _image_batch([path], meta, notes.append)
        assert x.dtype == np.float32 and np.allclose(x, want) and names == [str(path)]
        span = "0..255" if want > 1 else "0..1"
        assert notes == [f"the model was trained on arrays of floats, not image files; the "
                         f"images are given as {span} values, the range of its training data"]


def test_table_features_with_missing_values_are_one_line(tmp_path):
    rows = ["a,empty,b,label"] + [f"{i},,{'' if i == 3 else i * 2},{'xy'[i % 2]}"
                                  for i in range(10)]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    with pytest.raises(UserError, match=re.escape(
            "feature column(s) ['empty'] of ") + ".*" + re.escape(
            "have no values at all (missing from its file?): drop them from the table, or, "
            "for a saved model's columns, give data that has them")):
        load(str(tmp_path / "t.csv"))
    rows = ["a,b,label"] + [f"{i},{'' if i == 3 else i * 2},{'xy'[i % 2]}" for i in range(10)]
    (tmp_path / "u.csv").write_text("\n".join(rows) + "\n")
    with pytest.raises(UserError, match=re.escape("feature column(s) ['b'] of ") + ".*" +
                       re.escape("have empty, NaN or infinite values: fill or drop them")):
        load(str(tmp_path / "u.csv"))
