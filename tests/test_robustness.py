"""Bad input found by trying to break the tool: each gets a one-line UserError, nothing lost."""

import json
import os
import warnings

import numpy as np
import pytest
from PIL import Image

from fedavg.config.settings import RunConfig
from fedavg.data.load import decode_images, load
from fedavg.data.partition import partition
from fedavg.models.evaluation import evaluation_device, resolve_device
from fedavg.models.registry import build_model
from fedavg.run import checkpoint
from fedavg.run.lifecycle import check_output, default_output, prepare
from fedavg.util.errors import UserError


def write_csv(path, header, rows):
    path.write_text(header + "\n" + "\n".join(rows) + "\n")
    return str(path)


def test_empty_label_cells(tmp_path):
    path = write_csv(tmp_path / "d.csv", "a,b,label",
                     ["1,2,x", "3,4,", "5,6,y", "7,8,x", "1,1,y"])
    with pytest.raises(UserError, match=r"1 empty value\(s\) \(data row 1, counting from 0\)"):
        load(path)
    folder = tmp_path / "splits"  # an empty label in the test file
    folder.mkdir()
    write_csv(folder / "train.csv", "a,b,label", ["1,2,x", "3,4,y", "5,6,y", "7,8,x"])
    write_csv(folder / "test.csv", "a,b,label", ["1,2,x", "3,4,", "5,6,y"])
    with pytest.raises(UserError, match=r"label column 'label' has 1 empty value\(s\) \(data row "
                                        r"1, counting from 0\) in split 'test': fill or drop"):
        load(str(folder))


def test_a_test_file_without_a_feature_column_is_named_as_such(tmp_path):
    folder = tmp_path / "splits"
    folder.mkdir()
    write_csv(folder / "train.csv", "a,c,label", ["1,2,x", "3,4,y", "5,6,y", "7,8,x"])
    write_csv(folder / "test.csv", "a,label", ["1,x", "3,y"])
    with pytest.raises(UserError, match=r"feature column\(s\) \['c'\] of \S+'s test split have "
                                        r"no values at all \(missing from its file\?\)"):
        load(str(folder))


def test_a_table_that_is_not_utf8_says_to_save_it_as_utf8(tmp_path):
    path = tmp_path / "latin.csv"
    path.write_bytes("a,label\n1,caf\u00e9\n2,th\u00e9\n3,caf\u00e9\n".encode("latin-1"))
    with pytest.raises(UserError, match=r"cannot read dataset at \S+latin.csv: .*'utf-8' codec "
                                        r"can't decode .*; save it as UTF-8$"):
        load(str(path))


def test_nan_in_feature_column_is_named(tmp_path):
    path = write_csv(tmp_path / "d.csv", "a,b,label",
                     ["1,2,0", "3,,1", "5,6,0", "7,8,1", "1,1,0"])
    with pytest.raises(UserError, match=r"\['b'\]"):
        load(path)


def test_single_class_and_label_as_input(tmp_path):
    path = write_csv(tmp_path / "d.csv", "a,b,label", ["1,2,0", "3,4,0", "5,6,0"])
    with pytest.raises(UserError, match="single class"):
        load(path)
    path = write_csv(tmp_path / "e.csv", "a,b,label", ["1,2,0", "3,4,1", "5,6,0"])
    with pytest.raises(UserError, match="both the input and the label; pass another "
                                        "--image-column or --label-column"):
        load(path, image_column="label")
    text = write_csv(tmp_path / "t.csv", "title,topic", ["a good day,good", "a bad day,bad"])
    with pytest.raises(UserError, match="both the input and the label; pass another "
                                        "--text-column or --label-column"):  # the flag given
        load(text, text_column="topic", label_column="topic")


def test_builtin_has_no_columns():
    with pytest.raises(UserError, match="built-in digits dataset has no columns"):
        load("digits", partition_by="writer")


def test_16_bit_grey_images_are_scaled_not_clipped(tmp_path):
    values = np.array([[0, 32896], [65535, 257]], dtype=np.uint16)
    path = tmp_path / "wide.png"
    Image.fromarray(values).save(path)
    x = decode_images([str(path)])
    assert x.shape == (1, 1, 2, 2)
    # 65535 -> 255, 32896 -> 128, 257 -> 1 (value * 255 / 65535)
    assert x[0, 0].tolist() == [[0, 128], [255, 1]]


def test_float_and_32_bit_grey_images_are_scaled_by_their_type_not_each_image(tmp_path):
    floats = tmp_path / "f.tif"  # mode F, 0..1
    Image.fromarray(np.array([[0.0, 0.5], [1.0, 0.25]], dtype=np.float32)).save(floats)
    assert decode_images([str(floats)])[0, 0].tolist() == [[0, 127], [255, 63]]
    paths = []  # mode I: the same pixel values read the same in every image
    for i, peak in enumerate((200, 100)):
        paths.append(tmp_path / f"i{i}.tif")
        Image.fromarray(np.array([[0, peak]], dtype=np.int32)).save(paths[-1])
    assert Image.open(paths[0]).mode == "I"
    x = decode_images([str(p) for p in paths])
    assert x[0, 0].tolist() == [[0, 200]] and x[1, 0].tolist() == [[0, 100]]
    # one bright pixel in one image sets the range of all: 300 > 255 -> 16-bit range
    Image.fromarray(np.array([[200, 300]], dtype=np.int32)).save(paths[1])
    x = decode_images([str(p) for p in paths])  # 200 * 255 / 65535 = 0.78 -> 0; 300 -> 1
    assert x[0, 0].tolist() == [[0, 0]] and x[1, 0].tolist() == [[0, 1]]
    bright = tmp_path / "g.tif"  # floats over 1 in one image: 0..255 for both
    Image.fromarray(np.array([[0.8, 1.2]], dtype=np.float32)).save(bright)
    dim = tmp_path / "h.tif"
    Image.fromarray(np.array([[0.8, 0.8]], dtype=np.float32)).save(dim)
    assert decode_images([str(bright), str(dim)])[:, 0].tolist() == [[[0, 1]], [[0, 0]]]


def test_images_with_transparent_pixels_are_counted_in_a_note(tmp_path):
    rgba = np.zeros((2, 2, 4), np.uint8)
    rgba[..., 3] = 255
    Image.fromarray(rgba).save(tmp_path / "opaque.png")  # an alpha channel, all opaque
    rgba[0, 0, 3] = 0
    Image.fromarray(rgba).save(tmp_path / "clear.png")
    grey_alpha = np.array([[[10, 255], [20, 128]]] * 2, np.uint8)  # LA, half transparent
    Image.fromarray(grey_alpha, mode="LA").save(tmp_path / "la.png")
    palette = Image.fromarray(np.array([[0, 1], [1, 0]], np.uint8), mode="P")
    palette.putpalette([255, 0, 0, 0, 0, 255])
    palette.save(tmp_path / "p.png", transparency=1)  # blue is transparent
    Image.fromarray(np.zeros((2, 2, 3), np.uint8)).save(tmp_path / "rgb.png")
    names = ["opaque", "clear", "la", "p", "rgb"]
    notes = []
    x = decode_images([str(tmp_path / f"{n}.png") for n in names], "pics", notes=notes)
    assert x.shape == (5, 3, 2, 2)
    found = [n for n in notes if "transparent" in n]
    assert found == ["3 of 5 images of pics have transparent pixels: read as the colour stored "
                     "under them (the alpha channel is dropped); to choose the background, "
                     "flatten them onto it first"]
    assert x[1, :, 0, 0].tolist() == [0, 0, 0]  # the colour under the transparent pixel
    notes = []
    decode_images([str(tmp_path / f"{n}.png") for n in ("opaque", "rgb")], "pics", notes=notes)
    assert not any("transparent" in n for n in notes)


def test_a_palette_image_of_greys_is_grey(tmp_path):
    path = tmp_path / "p.gif"
    Image.fromarray(np.array([[0, 90], [180, 255]], dtype=np.uint8)).convert("P").save(path)
    assert Image.open(path).mode == "P"
    notes = []
    x = decode_images([str(path)], "gif", notes=notes)
    assert x.shape == (1, 1, 2, 2) and x[0, 0].tolist() == [[0, 90], [180, 255]]
    assert notes == []


def test_a_grey_first_image_does_not_grey_the_colour_ones(tmp_path):
    grey = tmp_path / "a.png"
    Image.fromarray(np.full((4, 4), 100, dtype=np.uint8)).save(grey)
    red = tmp_path / "b.png"
    Image.fromarray(np.tile(np.array([200, 10, 30], np.uint8), (4, 4, 1))).save(red)
    notes = []
    x = decode_images([str(grey), str(red)], "imgs", notes=notes)
    assert x.shape == (2, 3, 4, 4)
    assert x[0, :, 0, 0].tolist() == [100, 100, 100]  # grey copied to the 3 channels
    assert x[1, :, 0, 0].tolist() == [200, 10, 30]  # the colour kept
    assert notes == ["1 of 2 images of imgs converted to RGB"]


def test_images_take_the_most_common_size_not_the_first(tmp_path):
    paths = []
    for i, side in enumerate((6, 4, 4)):
        paths.append(tmp_path / f"{i}.png")
        Image.fromarray(np.full((side, side), 50 * i, dtype=np.uint8)).save(paths[-1])
    notes = []
    x = decode_images([str(p) for p in paths], "imgs", notes=notes)
    assert x.shape == (3, 1, 4, 4)
    assert x[0, 0].tolist() == [[0] * 4] * 4  # a uniform image stays uniform when resized
    assert notes == ["1 of 3 images of imgs resized to 4x4, the most common size"]
    assert decode_images([str(p) for p in paths], "imgs").shape == (3, 1, 4, 4)  # no list


def test_other_splits_are_decoded_as_the_train_split_is(tmp_path):
    """A test split whose first image is colour and larger is read as train's images are."""
    for split, n in (("train", 6), ("test", 4)):
        for i in range(n):
            folder = tmp_path / split / ("a" if i % 2 else "b")
            folder.mkdir(parents=True, exist_ok=True)
            img = Image.fromarray(np.full((8, 8), 20 * i, dtype=np.uint8))
            if split == "test" and i == 0:
                img = img.convert("RGB").resize((16, 16))
            img.save(folder / f"{i}.png")
    data = load(str(tmp_path))
    assert data.splits["train"].x.shape[1:] == data.splits["test"].x.shape[1:] == (1, 8, 8)
    assert sorted(n for n in data.notes if "split" in n) == [
        f"1 of 4 images of {tmp_path}'s test split converted to grey",
        f"1 of 4 images of {tmp_path}'s test split resized to 8x8"]


def test_seed_and_device_checks():
    with pytest.raises(UserError, match="--seed must be >= 0"):
        RunConfig().replace(seed=-1).validate()
    for bad in ("mps", "foo", "meta"):
        with pytest.raises(UserError, match="unknown device"):
            resolve_device(bad)
    assert resolve_device("cpu").type == "cpu"


def test_the_coordinator_evaluates_on_its_own_gpu_or_cpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for setting in ("auto", "cpu", "cuda", "cuda:1"):  # nodes' GPUs the coordinator lacks
        assert evaluation_device(setting) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert evaluation_device("auto") == torch.device("cuda")
    assert evaluation_device("cuda:0") == torch.device("cuda:0")
    assert evaluation_device("cuda:3") == torch.device("cuda")  # a node's index, not here
    assert evaluation_device("cpu") == torch.device("cpu")


def test_natural_partition_refuses_empty_ids():
    groups = np.array(["a", "b", "None", "a", "b", "nan"])
    with pytest.raises(UserError, match="2 empty value"):
        partition(np.zeros(6, int), 4, "natural", groups=groups)


def test_impossible_dirichlet_says_one_thing():
    labels = np.repeat(np.arange(10), 20)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(UserError, match="fewer --num-nodes or a larger --alpha"):
            partition(labels, 150, "dirichlet", alpha=0.001)
    assert not caught


GOOD_META = {
    "model": {"name": "mlp", "input_shape": [1, 8, 8], "num_classes": 3, "args": {}},
    "classes": ["a", "b", "c"],
    "input": {"shape": [1, 8, 8], "dtype": "uint8", "scale": 1 / 255, "mean": [0.3],
              "std": [0.2]},
}


@pytest.mark.parametrize("change, message", [
    ({"classes": 5}, "'classes'"),
    ({"classes": ["a", "b"]}, "2 names, the model 3 outputs"),
    ({"model": {"name": "mlp", "num_classes": "ten"}},
     "'model.num_classes' must be a whole number >= 1 (got 'ten')"),
    ({"input": []}, "'input' must be an object"),
    ({"input": {**GOOD_META["input"], "mean": [0.1, 0.2, 0.3]}}, "'input.mean' must hold 1"),
    ({"input": {**GOOD_META["input"], "std": [0]}}, "must be > 0"),
    ({"input": {**GOOD_META["input"], "scale": "big"}}, "'input.scale'"),
    ({"input": {**GOOD_META["input"], "shape": "abc"}}, "'input.shape'"),
    ({"dataset": "digits"}, "'dataset' must be an object"),
    ({"classes": ["a", "b", "a"]}, "must be distinct"),
    ({"input": {**GOOD_META["input"], "kind": "weird"}}, "'input.kind' must be one of"),
    *[({"kind": "ensemble", "member_weights": w}, "'member_weights'")
      for w in ([float("nan"), 1, 1], ["a", "b", "c"], [0, 0], [-1, 2], [], [float("inf"), 1])],
])
def test_damaged_model_json_is_refused(tmp_path, change, message):
    checkpoint.save(tmp_path, build_model("mlp", (1, 8, 8), 3).state_dict(), GOOD_META)
    meta = json.loads((tmp_path / "model.json").read_text())
    meta.update(change)
    (tmp_path / "model.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="damaged") as info:
        checkpoint.load(tmp_path)
    assert message in str(info.value)


def test_artifacts_are_readable_like_other_files(tmp_path):
    checkpoint.save(tmp_path, build_model("mlp", (1, 8, 8), 3).state_dict(), GOOD_META)
    umask = os.umask(0)
    os.umask(umask)
    for name in ("model.json", "model.safetensors"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~umask


def test_output_folder_of_a_previous_run_is_not_overwritten(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(UserError, match="--overwrite to replace it$"):
        check_output(tmp_path, overwrite=False)
    (tmp_path / "checkpoint.safetensors").write_bytes(b"")  # a run stopped half-way
    with pytest.raises(UserError, match=f"--overwrite to replace it \\(or --resume {tmp_path} "
                                        "to finish it\\)$"):
        check_output(tmp_path, overwrite=False)
    check_output(tmp_path, overwrite=True)
    check_output(tmp_path / "new", overwrite=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        check_output(tmp_path / "file", overwrite=True)


def test_default_run_folders_are_distinct(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first, second = default_output(), default_output()
    assert first != second and first.is_dir() and second.is_dir()


def test_local_dataset_path_is_stored_absolute(tmp_path, monkeypatch):
    write_csv(tmp_path / "d.csv", "a,b,label", [f"{i},{i % 3},{i % 2}" for i in range(20)])
    monkeypatch.chdir(tmp_path)
    prepared = prepare(RunConfig().replace(dataset="d.csv", num_nodes=2))
    assert prepared.meta["dataset"]["source"] == str((tmp_path / "d.csv").resolve())


def test_very_large_images_warn_nothing_and_oversized_ones_are_one_line(tmp_path, monkeypatch):
    """Pillow's decompression-bomb warning (its source path) stays off stderr; its limit holds."""
    import warnings

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10)  # 16 pixels warn, over 20 are refused
    Image.fromarray(np.zeros((4, 4), np.uint8)).save(tmp_path / "large.png")
    Image.fromarray(np.zeros((5, 5), np.uint8)).save(tmp_path / "huge.png")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert decode_images([str(tmp_path / "large.png")]).shape == (1, 1, 4, 4)
    assert not [w for w in caught if issubclass(w.category, Image.DecompressionBombWarning)]
    with pytest.raises(UserError, match="cannot decode image .*huge.png of .*exceeds limit"):
        decode_images([str(tmp_path / "huge.png")], "pics")


def test_batch_size_one_is_refused_for_a_batchnorm_model(tmp_path):
    """Every one-sample batch was left out: the run trained nothing and said train loss 0."""
    code = tmp_path / "bn.py"
    code.write_text("from torch import nn\n\ndef bn(input_shape, num_classes):\n"
                    "    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.BatchNorm1d(32),"
                    " nn.ReLU(), nn.Linear(32, num_classes))\n")
    with pytest.raises(UserError, match=r"BatchNorm layers.*use --batch-size 2 or more"):
        prepare(RunConfig().replace(model=f"{code}:bn", batch_size=1))
    assert prepare(RunConfig().replace(model=f"{code}:bn", batch_size=2)).spec is not None
    assert prepare(RunConfig().replace(model="mlp", batch_size=1)).spec is not None
