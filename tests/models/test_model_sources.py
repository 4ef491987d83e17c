"""Bring your own model: ``torchvision:NAME``, ``hf:PATH``, ``module:function``, ``--model-arg``.

Unit tests build tiny models with random weights (nothing is downloaded); the end-to-end tests
at the bottom (marker ``e2e``) run the real CLI on digits.
"""

import json
import os
import re
import shutil
import signal
import sys

import pytest
import torch
from helpers.cli import assert_one_error_line, run_cli
from torch import nn
from typer.testing import CliRunner

import strategies
from fedavg.config.settings import RunConfig
from fedavg.models import sources as model_sources
from fedavg.models.registry import ModelSpec, build_model
from fedavg.models.sources import ImageAdapter, adapt_images, parse_model_args
from fedavg.run import checkpoint
from fedavg.util.errors import UserError

#: A user builder: an MLP whose two middle layers share ONE weight, with an integer counter.
TIED_SOURCE = '''
import torch
from torch import nn


class Tied(nn.Module):
    def __init__(self, d, hidden, k):
        super().__init__()
        self.inp = nn.Linear(d, hidden)
        self.mid = nn.Linear(hidden, hidden)
        self.mid2 = nn.Linear(hidden, hidden, bias=False)
        self.mid2.weight = self.mid.weight  # tied: two names, one tensor
        self.out = nn.Linear(hidden, k)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        if self.training:
            self.steps += 1
        h = torch.relu(self.inp(x.flatten(1)))
        return self.out(torch.relu(self.mid2(torch.relu(self.mid(h)))))


def build(input_shape, num_classes, hidden=32):
    d = 1
    for s in input_shape:
        d *= s
    return Tied(d, hidden, num_classes)


def build_text(input_shape, num_classes, vocab_size, width=4):
    return nn.Sequential(nn.Embedding(vocab_size, width), nn.Flatten(),
                         nn.Linear(input_shape[0] * width, num_classes))


def build_any(input_shape, num_classes, **kwargs):
    net = nn.Linear(1, num_classes)
    net.got = kwargs
    return net


def needs_depth(input_shape, num_classes, depth, width=8):
    return nn.Linear(1, num_classes)


def not_a_module(input_shape, num_classes):
    return [1, 2, 3]


def raises(input_shape, num_classes):
    raise ValueError("no model for you")
'''


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_models.py"
    path.write_text(TIED_SOURCE)
    return path


def _one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert "\n" not in text, text
    return text


# --------------------------------------------------------------------------- --model-arg


def test_model_args_are_json_scalars_else_text():
    got = parse_model_args(["hidden=64", "lr=0.5", "flag=true", "nothing=null", "act=relu",
                            'quoted="64"', "shape=[1, 2]", "nan=NaN", "eq=a=b", "empty="])
    assert got == {"hidden": 64, "lr": 0.5, "flag": True, "nothing": None, "act": "relu",
                   "quoted": "64", "shape": "[1, 2]", "nan": "NaN", "eq": "a=b", "empty": ""}
    assert isinstance(got["hidden"], int) and isinstance(got["lr"], float)
    assert parse_model_args(None) == {}


@pytest.mark.parametrize("items, words", [
    (["hidden"], "KEY=VALUE"), (["=3"], "KEY=VALUE"), (["1x=3"], "KEY=VALUE"),
    (["a=1", "a=2"], "--model-arg a is given twice"),
])
def test_bad_model_args_are_one_line(items, words):
    with pytest.raises(UserError) as exc:
        parse_model_args(items)
    assert words in _one_line(exc)


def test_model_args_travel_as_one_json_key_of_the_run_config():
    config = RunConfig().replace(model="mlp", model_args={"hidden": 64, "act": "relu"})
    flat = config.to_flat()
    assert flat["model-args"] == '{"act": "relu", "hidden": 64}'  # a scalar, for Flower
    assert all(not isinstance(v, dict) for v in flat.values())
    again = RunConfig.from_flat(flat)
    assert dict(again.train.model_args) == {"hidden": 64, "act": "relu"}
    assert again.as_dict()["train"]["model_args"] == {"hidden": 64, "act": "relu"}
    assert "model-args" not in RunConfig().to_flat()  # none: no key (old checkpoints match)
    with pytest.raises(UserError, match="'model-args' must be a JSON object"):
        RunConfig.from_flat({"model-args": "[1, 2]"})
    with pytest.raises(UserError, match="must be a JSON object"):
        RunConfig.from_flat({"model-args": "{nope"})


def test_resume_refuses_other_model_args():
    from fedavg.run import resume

    saved = RunConfig().replace(model_args={"hidden": 64}, rounds=2)
    ckpt = resume.Checkpoint(round=1, model={}, config=saved.to_flat())
    with pytest.raises(UserError) as exc:
        resume.resumed_config(ckpt, saved.replace(model_args={"hidden": 32}), "runs/x")
    assert '--model-arg {"hidden": 32} differs' in _one_line(exc)  # the option's name
    assert '"hidden": 64' in str(exc.value)
    assert resume.resumed_config(ckpt, saved, "runs/x").train.model_args == {"hidden": 64}


# --------------------------------------------------------------------------- signature checks


def test_builtin_models_take_their_declared_arguments_only():
    net = build_model("mlp", (1, 8, 8), 10, hidden=16)
    assert net[1].out_features == 16 and net[-1].in_features == 16
    with pytest.raises(UserError) as exc:
        build_model("mlp", (1, 8, 8), 10, hiden=16)
    assert _one_line(exc) == ("model 'mlp' does not take argument 'hiden' (--model-arg "
                              "hiden=...); it takes: hidden")
    with pytest.raises(UserError, match="it takes: no arguments"):
        build_model("cnn-cifar", (3, 32, 32), 10, width=3)


def test_cnn_dense_is_densess_cifar_cnn_by_parameter_count_and_shape():
    """Three 3x3 convs of 128 (32 -> 30 -> pool 15 -> 13 -> pool 6 -> 4), then 2048 -> 10."""
    import torch

    net = build_model("cnn-dense", (3, 32, 32), 10)
    conv1 = 3 * 3 * 3 * 128 + 128  # 3,584
    conv23 = 2 * (128 * 3 * 3 * 128 + 128)  # 2 x 147,584
    linear = 128 * 4 * 4 * 10 + 10  # 20,490
    assert sum(p.numel() for p in net.parameters()) == conv1 + conv23 + linear == 319_242
    assert net(torch.zeros(5, 3, 32, 32)).shape == (5, 10)
    narrow = build_model("cnn-dense", (1, 28, 28), 4, width=8)  # 28 -> 26 -> 13 -> 11 -> 5 -> 3
    assert narrow[-1].in_features == 8 * 3 * 3 and narrow(torch.zeros(2, 1, 28, 28)).shape == (2, 4)
    with pytest.raises(UserError, match="cnn-dense needs image inputs"):
        build_model("cnn-dense", (64,), 10)


def test_user_builder_arguments_are_checked_before_the_call(user_file):
    with pytest.raises(UserError) as exc:
        build_model(f"{user_file}:build", (1, 8, 8), 10, hiden=3)
    assert "does not take argument 'hiden'" in _one_line(exc) and "it takes: hidden" in str(
        exc.value)
    with pytest.raises(UserError) as exc:
        build_model(f"{user_file}:needs_depth", (1, 8, 8), 10, width=3)
    assert "needs argument 'depth': pass --model-arg depth=VALUE" in _one_line(exc)
    assert build_model(f"{user_file}:build", (1, 8, 8), 10, hidden=7).mid.out_features == 7
    # **kwargs takes anything, the text data's arguments too
    net = build_model(f"{user_file}:build_any", (5,), 3, a=1, vocab_size=9, pad_id=0)
    assert net.got == {"a": 1, "vocab_size": 9, "pad_id": 0}


def test_text_arguments_reach_only_builders_that_take_them(user_file):
    # build takes neither vocab_size nor pad_id: it gets neither (no error)
    net = build_model(f"{user_file}:build", (6,), 3, vocab_size=50, pad_id=0)
    assert net.inp.in_features == 6
    # build_text takes vocab_size (named) but not pad_id
    net = build_model(f"{user_file}:build_text", (6,), 3, vocab_size=50, pad_id=0)
    assert net[0].num_embeddings == 50
    assert net(torch.randint(0, 50, (2, 6))).shape == (2, 3)


def test_a_text_model_whose_embedding_misses_part_of_the_vocabulary_is_refused(tmp_path):
    (tmp_path / "small.py").write_text(
        "import torch\n"
        "def build(input_shape, num_classes, vocab_size):\n"
        "    return torch.nn.Sequential(torch.nn.EmbeddingBag(vocab_size // 2, 8),\n"
        "                               torch.nn.Linear(8, num_classes))\n")
    spec = ModelSpec.resolve(f"{tmp_path / 'small.py'}:build", (6,), 3,
                             {"vocab_size": 50, "pad_id": 0})
    with pytest.raises(UserError) as exc:  # nodes failed with IndexError in round 1
        spec.check(spec.build())
    assert "fails on a batch of token ids 0..49 (the vocabulary) of shape (2, 6): " \
        in _one_line(exc)


def test_torchvision_arguments_are_checked(monkeypatch):
    net = build_model("torchvision:mobilenet_v3_small", (3, 32, 32), 5, dropout=0.5)
    assert net.net.classifier[2].p == 0.5
    with pytest.raises(UserError) as exc:
        build_model("torchvision:mobilenet_v3_small", (3, 32, 32), 5, dropuot=0.5)
    line = _one_line(exc)
    assert "does not take argument 'dropuot'" in line and "dropout" in line
    with pytest.raises(UserError, match="does not take argument 'num_classes'"):
        ModelSpec.resolve("torchvision:resnet18", (3, 32, 32), 5, {"num_classes": 7}).build()


def test_torchvision_arguments_named_are_those_a_model_arg_can_set():
    """Not resnet18's block and layers (its builder sets them) nor norm_layer (a callable).

    A regnet failed to build at all: its builder computes with tensors, which the
    weightless probe has not.
    """
    with pytest.raises(UserError) as exc:
        build_model("torchvision:resnet18", (3, 32, 32), 5, blocks=2)
    assert _one_line(exc).endswith("it takes: zero_init_residual, groups, width_per_group, "
                                   "replace_stride_with_dilation")
    for name in ("block", "layers", "norm_layer"):
        with pytest.raises(UserError, match=f"does not take argument '{name}'"):
            build_model("torchvision:resnet18", (3, 32, 32), 5, **{name: 1})
    zero = build_model("torchvision:resnet18", (3, 32, 32), 5, zero_init_residual=True)
    assert not zero.net.layer1[0].bn2.weight.any()  # a listed one is passed
    regnet = build_model("torchvision:regnet_x_400mf", (3, 32, 32), 5, stem_width=16)
    assert regnet.net.stem[0].out_channels == 16
    with pytest.raises(UserError, match="it takes: stem_width$"):
        build_model("torchvision:regnet_x_400mf", (3, 32, 32), 5, block_params=1)


# --------------------------------------------------------------------------- torchvision


def test_torchvision_model_gets_a_head_for_the_classes_and_no_download(fake_download):
    spec = ModelSpec.resolve("torchvision:resnet18", (3, 16, 16), 7)
    net = spec.build(initial=True)  # pretrained is off: random weights
    assert fake_download == []
    assert net.net.fc.out_features == 7
    assert net(torch.zeros(2, 3, 16, 16)).shape == (2, 7)
    assert spec.check(net) == []  # 3 channels, and 16x16 works: nothing adapted


def test_unknown_torchvision_name_is_one_line_with_close_matches():
    with pytest.raises(UserError) as exc:
        build_model("torchvision:resnet19", (3, 32, 32), 5)
    line = _one_line(exc)
    assert "unknown torchvision model 'resnet19'" in line and "resnet18" in line
    assert "torchvision.models.list_models" in line


@pytest.fixture
def fake_download(monkeypatch):
    """Use torchvision's real ``weights="DEFAULT"`` path, with the download replaced.

    The "downloaded" ImageNet ResNet-18 has its stem weights all 0.5; the URLs asked for are
    recorded.
    """
    import torchvision.models._api as api
    from torchvision.models import resnet18

    urls = []

    def load_state_dict_from_url(url, *args, **kwargs):
        urls.append(url)
        state = resnet18(weights=None).state_dict()
        return {k: v.fill_(0.5) if k.endswith("conv1.weight") else v for k, v in state.items()}

    monkeypatch.setattr(api, "load_state_dict_from_url", load_state_dict_from_url)
    return urls


def test_pretrained_loads_default_weights_only_for_the_initial_model(fake_download):
    spec = ModelSpec.resolve("torchvision:resnet18", (1, 8, 8), 10, pretrained=True)
    assert "pretrained" not in spec.as_dict()["args"]  # nodes never see it
    assert fake_download == []  # resolving and checking download nothing
    initial = spec.build(initial=True)
    assert len(fake_download) == 1 and "resnet18" in fake_download[0]
    assert bool((initial.net.conv1.weight == 0.5).all())  # the downloaded weights
    assert isinstance(initial.net.fc, nn.Linear) and initial.net.fc.out_features == 10
    later = spec.build()  # a node, predict: weights=None, weights come as a state dict
    assert len(fake_download) == 1 and not bool((later.net.conv1.weight == 0.5).all())
    assert initial.state_dict().keys() == later.state_dict().keys()
    later.load_state_dict(initial.state_dict())
    assert any("pretrained weights" in n for n in spec.check(initial))
    ModelSpec.resolve("torchvision:resnet18", (1, 8, 8), 10).build(initial=True)
    assert len(fake_download) == 1  # without --pretrained: nothing downloaded


def test_pretrained_download_failure_is_one_line(monkeypatch):
    import torchvision.models._api as api

    def offline(url, *args, **kwargs):
        raise OSError("<urlopen error [Errno -3] Temporary failure in name resolution>\nmore")

    monkeypatch.setattr(api, "load_state_dict_from_url", offline)
    with pytest.raises(UserError) as exc:
        model_sources.build_torchvision("resnet18", (3, 8, 8), 4, {}, pretrained=True)
    assert "could not load its pretrained weights (OSError: <urlopen error" in _one_line(exc)
    assert "without --pretrained" in str(exc.value)


def test_pretrained_needs_a_torchvision_model():
    with pytest.raises(UserError, match="--pretrained takes a torchvision:NAME model"):
        RunConfig().replace(model="mlp", pretrained=True).validate()
    RunConfig().replace(model="torchvision:resnet18", pretrained=True).validate()
    # the flag of older configs means torchvision's own weights
    assert RunConfig().replace(pretrained=True).train.pretrained == "default"
    assert RunConfig().replace(pretrained=False).train.pretrained is None


# --------------------------------------------------------------------------- adapters


class _Recorder(nn.Module):
    """A 3-channel conv stem that records what it is fed; fails unless H == W == size."""

    def __init__(self, size=None):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.fc = nn.Linear(4, 2)
        self.size, self.seen = size, []

    def forward(self, x):
        self.seen.append(x)
        if self.size is not None and x.shape[-1] != self.size:
            raise ValueError(f"wants {self.size}x{self.size}")
        return self.fc(self.conv(x).mean((2, 3)))


def test_one_channel_is_repeated_to_three_without_new_parameters():
    net = _Recorder()
    model = adapt_images(net, (1, 5, 5), "test")
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in net.parameters())
    assert model.state_dict().keys() == {f"net.{k}" for k in net.state_dict()}
    x = torch.randn(4, 1, 5, 5)
    model(x)
    fed = net.seen[-1]
    assert fed.shape == (4, 3, 5, 5) and all(torch.equal(fed[:, c], x[:, 0]) for c in range(3))
    assert model.size is None  # 5x5 works: not resized
    assert model.fedavg_notes == ["model test: 1-channel inputs repeated to the model's 3 channels"]


def test_inputs_are_resized_only_when_the_trial_pass_fails():
    net = _Recorder(size=12)
    net.image_size = 12
    model = adapt_images(net, (3, 6, 6), "test")
    assert model.size == (12, 12) and model.channels is None
    x = torch.randn(2, 3, 6, 6)
    model(x)
    expected = nn.functional.interpolate(x, size=(12, 12), mode="bilinear", align_corners=False)
    assert torch.equal(net.seen[-1], expected)
    assert "inputs resized from 6x6 to 12x12" in model.fedavg_notes[0]
    assert "wants 12x12" in model.fedavg_notes[0]  # why


def test_a_real_torchvision_model_that_fails_small_is_resized():
    model = build_model("torchvision:squeezenet1_1", (1, 8, 8), 10)
    assert model.channels == 3 and model.size == (224, 224)
    assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    fits = build_model("torchvision:mobilenet_v3_small", (1, 8, 8), 10)
    assert fits.channels == 3 and fits.size is None


def test_image_models_refuse_what_they_cannot_take():
    with pytest.raises(UserError) as exc:
        build_model("torchvision:resnet18", (2, 16, 16), 10)
    assert "takes 3-channel images; the data have 2 channel(s)" in _one_line(exc)
    with pytest.raises(UserError) as exc:
        build_model("torchvision:resnet18", (64,), 10)
    assert "takes images (C, H, W); the data are of shape (64,)" in _one_line(exc)

    class Never(_Recorder):
        def forward(self, x):
            raise RuntimeError("never fits")

    with pytest.raises(UserError) as exc:
        adapt_images(Never(), (3, 8, 8), "never")
    assert "nor resized to 224x224" in _one_line(exc)


def test_a_weightless_copy_has_the_same_state_dict_keys():
    real = build_model("torchvision:squeezenet1_1", (1, 8, 8), 10)
    with torch.device("meta"):
        skeleton = build_model("torchvision:squeezenet1_1", (1, 8, 8), 10)
    assert isinstance(skeleton, ImageAdapter) and skeleton.size is None  # no trial on meta
    assert {k: v.shape for k, v in skeleton.state_dict().items()} == \
        {k: v.shape for k, v in real.state_dict().items()}


# --------------------------------------------------------------------------- tied + integer


def test_tied_and_integer_tensors_save_load_and_merge(user_file, tmp_path):
    from safetensors.torch import save_file

    spec = ModelSpec.resolve(str(user_file) + ":build", (1, 8, 8), 3, {"hidden": 4})
    a, b = spec.build(), spec.build()
    sd = a.state_dict()
    assert sd["mid.weight"].data_ptr() == sd["mid2.weight"].data_ptr()  # really tied
    with pytest.raises(RuntimeError, match="share memory"):
        save_file(sd, str(tmp_path / "raw.safetensors"))  # what checkpoint.save must avoid
    a.steps.fill_(3)
    b.steps.fill_(5)
    meta = {"model": spec.as_dict(), "classes": ["a", "b", "c"],
            "input": {"shape": [1, 8, 8], "dtype": "uint8", "scale": 1 / 255, "mean": [0.3],
                      "std": [0.4]}}
    checkpoint.save(tmp_path / "a", a.state_dict(), meta)
    checkpoint.save(tmp_path / "b", b.state_dict(), meta)
    loaded_a, _ = checkpoint.load(tmp_path / "a")
    loaded_b, _ = checkpoint.load(tmp_path / "b")
    assert torch.equal(loaded_a["mid.weight"], loaded_a["mid2.weight"])
    assert loaded_a["steps"].dtype == torch.int64 and int(loaded_a["steps"]) == 3

    merged = strategies.get("fedavg").merge([loaded_a, loaded_b], [1.0, 3.0], ["a", "b"],
                                            buffers=frozenset({"steps"})).state_dict
    want = 0.25 * a.mid.weight.detach() + 0.75 * b.mid.weight.detach()
    assert torch.allclose(merged["mid.weight"], want) and torch.allclose(merged["mid2.weight"],
                                                                        want)
    assert merged["steps"].dtype == torch.int64 and int(merged["steps"]) == 5  # max, not 4.5
    fresh = spec.build()
    fresh.load_state_dict(merged)
    assert fresh.mid.weight is fresh.mid2.weight and torch.allclose(fresh.mid2.weight, want)
    # the run's checkpoint too
    from fedavg.run import resume

    resume.save(tmp_path / "a", resume.Checkpoint(round=1, model=a.state_dict(),
                                                  config=RunConfig().to_flat()))


# --------------------------------------------------------------------------- your own code


def test_a_file_builder_is_stored_absolute(user_file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = ModelSpec.resolve("my_models.py:build", (1, 8, 8), 10, {"hidden": 8})
    assert spec.name == f"{user_file}:build" and os.path.isabs(spec.name.rpartition(":")[0])
    assert spec.as_dict()["args"] == {"hidden": 8}
    monkeypatch.chdir("/")
    assert isinstance(ModelSpec.from_dict(spec.as_dict()).build(), nn.Module)


def test_a_file_builder_imports_its_own_modules_beside_it(tmp_path, monkeypatch):
    """``from layers import head`` beside the builder file was a ModuleNotFoundError."""
    code = tmp_path / "proj"
    code.mkdir()
    (code / "fedavg_test_layers_x.py").write_text(
        "from torch import nn\n\ndef head(k):\n    return nn.Linear(64, k)\n")
    (code / "net.py").write_text(
        "from torch import nn\nfrom fedavg_test_layers_x import head\n\n"
        "def build(input_shape, num_classes):\n"
        "    return nn.Sequential(nn.Flatten(), head(num_classes))\n")
    monkeypatch.setattr(sys, "path", list(sys.path))  # the folder added goes with the test
    monkeypatch.chdir("/")
    net = ModelSpec.resolve(f"{code / 'net.py'}:build", (1, 8, 8), 10, {}).build()
    assert net(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    assert sys.path[-1] == str(code)  # after every other entry: it shadows nothing


def test_a_module_builder(tmp_path, monkeypatch):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "nets.py").write_text(TIED_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    net = build_model("mypkg.nets:build", (1, 8, 8), 4, hidden=5)
    assert net.out.out_features == 4 and net.mid.in_features == 5


@pytest.mark.parametrize("source, name, words", [
    (None, "nosuchpkg_xyz.models:build", "module nosuchpkg_xyz.models is not importable here: "
     "install it or add its folder to PYTHONPATH"),
    ("raise ImportError('needs a GPU library')\n", "FILE:build",
     "failed: ImportError: needs a GPU library"),
    ("def build(:\n", "FILE:build", "failed: SyntaxError"),
    (TIED_SOURCE, "FILE:buidl", "has no function 'buidl' (model"),
    (TIED_SOURCE, "FILE:not_a_module", "returned a list, not a torch.nn.Module"),
    (TIED_SOURCE, "FILE:raises", "failed: ValueError: no model for you"),
    (TIED_SOURCE, "FILE:", "name the builder function after the colon"),
    (None, "FILE:build", "does not exist here: put the file there"),
    (None, "DIR:build", "DIR is a folder: name the .py file that holds the builder"),
    ("import sys\nsys.exit(3)\n", "FILE:build", "called sys.exit(3); model code must not exit"),
    ("import sys\ndef build(shape, k):\n    sys.exit('no')\n", "FILE:build",
     "called sys.exit('no')"),
    (TIED_SOURCE, ":build", "name the module or .py file before the colon"),
    (TIED_SOURCE, "FILE", "name the builder function in it too, FILE:FUNCTION (e.g. FILE:build)"),
    (TIED_SOURCE, "TXT:build", "TXT is not a Python file (a .py file with the builder"),
    ("import torch\ndef build(shape, k):\n    return torch.nn.Linear(64 + torch.randint(9, ()), "
     "k)\n", "TWO:build", "size mismatch for weight"),  # another architecture each call
])
def test_bad_user_code_is_one_line(tmp_path, source, name, words):
    path = tmp_path / "bad_models.py"
    if source is not None:
        path.write_text(source)
    (tmp_path / "models.txt").write_text(TIED_SOURCE)
    words = words.replace("FILE", str(path)).replace("TXT", str(tmp_path / "models.txt")) \
        .replace("DIR", str(tmp_path))
    if name.startswith("TWO"):  # as a node loads the coordinator's weights
        from fedavg.models.sources import first_line

        torch.manual_seed(0)
        build = f"{path}:build"
        with pytest.raises(RuntimeError) as err:
            for _ in range(20):
                build_model(build, (64,), 10).load_state_dict(
                    build_model(build, (64,), 10).state_dict())
        assert words in first_line(err.value) and first_line(err.value).startswith(
            "RuntimeError: Error(s) in loading state_dict for Linear: size mismatch")
        return
    with pytest.raises(UserError) as exc:
        build_model(name.replace("FILE", str(path)).replace("TXT", str(tmp_path / "models.txt"))
                    .replace("DIR", str(tmp_path)), (1, 8, 8), 10)
    assert words in _one_line(exc)


LAZY_SOURCE = (
    "import torch\n"
    "def build(input_shape, num_classes):\n"
    "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(16),\n"
    "                               torch.nn.ReLU(), torch.nn.Linear(16, num_classes))\n"
    "def bad(input_shape, num_classes):\n"
    "    return torch.nn.Sequential(torch.nn.LazyLinear(16), torch.nn.Linear(3, num_classes))\n")


def test_a_model_file_edited_since_it_was_imported_is_imported_anew(tmp_path):
    """In a notebook: run, edit the builder's file, run again (the nodes read the new file)."""
    import os

    path = tmp_path / "nb_model.py"
    path.write_text("import torch\ndef build(shape, k):\n    return torch.nn.Linear(64, 16)\n")
    assert build_model(f"{path}:build", (64,), 16).out_features == 16
    path.write_text("import torch\ndef build(shape, k):\n    return torch.nn.Linear(64, 48)\n")
    os.utime(path, ns=(1, 1))  # a new modification time even on a coarse clock
    assert build_model(f"{path}:build", (64,), 48).out_features == 48


def test_a_builder_with_lazy_modules_gets_their_shapes_before_its_weights_are_used(tmp_path):
    path = tmp_path / "lazy.py"
    path.write_text(LAZY_SOURCE)
    a, b = (build_model(f"{path}:build", (1, 8, 8), 10) for _ in range(2))
    state = a.state_dict()  # raised "uninitialized parameter": the coordinator's first step
    assert state["1.weight"].shape == (16, 64) and state["3.weight"].shape == (10, 16)
    b.load_state_dict(state)  # a node loads the coordinator's weights
    assert torch.equal(b.state_dict()["1.weight"], state["1.weight"])
    with pytest.raises(UserError) as exc:
        build_model(f"{path}:bad", (1, 8, 8), 10)
    assert "its lazy modules fail on a batch of shape (2, 1, 8, 8): " in _one_line(exc)


def test_loading_a_run_whose_code_is_not_importable_says_what(user_file, tmp_path):
    import fedavg

    spec = ModelSpec.resolve(f"{user_file}:build", (1, 8, 8), 10)
    meta = {"model": spec.as_dict(), "classes": [str(i) for i in range(10)],
            "input": {"shape": [1, 8, 8], "dtype": "uint8", "scale": 1 / 255, "mean": [0.3],
                      "std": [0.4]}}
    checkpoint.save(tmp_path / "run", spec.build().state_dict(), meta)
    assert isinstance(fedavg.load_model(tmp_path / "run", model=f"{user_file}:build"),
                      nn.Module)
    user_file.unlink()
    with pytest.raises(UserError) as exc:
        fedavg.load_model(tmp_path / "run", model=f"{user_file}:build")
    assert f"{user_file} does not exist here" in _one_line(exc)
    json_path = tmp_path / "run" / "model.json"
    meta = json.loads(json_path.read_text())
    meta["model"]["name"] = "nosuchpkg_xyz.models:build"
    json_path.write_text(json.dumps(meta))
    proc = run_cli("evaluate", tmp_path / "run", "--model", "nosuchpkg_xyz.models:build",
                   check=False, timeout=120)
    assert proc.returncode == 2
    line = assert_one_error_line(proc.stderr)
    assert "module nosuchpkg_xyz.models is not importable here" in line


MARKER_SOURCE = TIED_SOURCE + (
    "\nimport os\nopen(os.environ['FEDAVG_TEST_MARKER'], 'w').close()  # ran on import\n")


def test_a_saved_model_never_imports_the_code_it_names_by_itself(tmp_path, monkeypatch,
                                                                   invoke):
    """A run folder from elsewhere names code (model.json): loading it runs none of it."""
    import fedavg

    code = tmp_path / "shipped.py"  # e.g. shipped inside someone else's run folder
    code.write_text(MARKER_SOURCE)
    marker = tmp_path / "imported"
    monkeypatch.setenv("FEDAVG_TEST_MARKER", str(marker))
    spec = ModelSpec(f"{code}:build", (1, 8, 8), 10, {})
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in ModelSpec("mlp", (1, 8, 8), 10, {}).build()
                  .state_dict().items()}
    meta = {"model": spec.as_dict(), "classes": [str(i) for i in range(10)],
            "input": {"shape": [1, 8, 8], "dtype": "uint8", "scale": 1 / 255, "mean": [0.3],
                      "std": [0.4]}}
    checkpoint.save(tmp_path / "run", {k: torch.zeros(s) for k, s in shapes.items()}, meta)
    words = (f"the model in {tmp_path / 'run'} is built by code, {code}:build: pass "
             f"model={code}:build to run it, if you trust that code")  # the Python API's names
    with pytest.raises(UserError, match=re.escape(words)):
        fedavg.load_model(tmp_path / "run")
    for args in (("evaluate", tmp_path / "run"), ("predict", tmp_path / "run", "digits"),
                 ("evaluate", tmp_path / "run", "--model", "mlp"),
                 ("evaluate", tmp_path / "run", "--model", "other.py:build")):
        code_, _, err = invoke(*args)
        assert code_ == 2 and "is built by code" in assert_one_error_line(err), err
    assert not marker.exists()  # nothing imported
    (tmp_path / "plain").mkdir()
    checkpoint.save(tmp_path / "plain", {k: torch.zeros(s) for k, s in shapes.items()},
                    {**meta, "model": {**meta["model"], "name": "mlp"}})
    code_, _, err = invoke("evaluate", tmp_path / "plain", "--model", f"{code}:build")
    assert code_ == 2 and "is mlp: leave --model out" in assert_one_error_line(err)
    assert not marker.exists()


# --------------------------------------------------------------------------- nodes


def test_nodes_run_only_code_their_operator_named(user_file, tmp_path, monkeypatch):
    from fedavg.models.sources import node_model, node_model_name

    # no opt-in for models that are not code
    for name in ("mlp", "torchvision:resnet18", "hf:/models/tiny"):
        assert node_model_name(name, None) == name
    run = "/coordinator/home/my_models.py:build"
    with pytest.raises(UserError) as exc:
        node_model_name(run, None)
    assert "start the node with --model my_models.py:build" in _one_line(exc)
    monkeypatch.chdir(tmp_path)
    own = node_model("my_models.py:build")
    assert own == f"{user_file}:build"  # this machine's file, made absolute
    assert node_model_name(run, own) == own  # the node's own copy, never the run's path
    with pytest.raises(UserError, match="started with --model"):
        node_model_name("/x/other.py:build", own)
    with pytest.raises(UserError, match="--model pkg.mod:build"):
        node_model_name("pkg.mod:build", "pkg.other:build")
    assert node_model_name("pkg.mod:build", "pkg.mod:build") == "pkg.mod:build"
    with pytest.raises(UserError, match="does not exist here"):
        node_model(str(tmp_path / "missing.py") + ":build")
    for name in ("mlp", "torchvision:resnet18", "hf:/models/tiny"):  # no opt-in needed
        with pytest.raises(UserError, match=re.escape(
                f"--model {name}: a node's --model names model code of yours")):
            node_model(name)  # it was ignored: the node trained the coordinator's model


def test_a_node_refuses_a_user_code_model_it_was_not_started_with(user_file):
    from fedavg.config.settings import LocalTraining
    from fedavg.node import deployed as apps
    from fedavg.node.wire import TrainSettings

    local = LocalTraining(local_epochs=1, batch_size=8, lr=0.1, momentum=0.0, weight_decay=0.0)
    settings = TrainSettings(model={"name": "/elsewhere/my_models.py:build",
                                    "input_shape": [1, 8, 8], "num_classes": 10, "args": {}},
                             input={}, classes=["a"], seed=0, local=local)
    with pytest.raises(UserError, match="start the node with --model my_models.py:build"):
        apps._own_model(settings, None)
    own = apps._own_model(settings, f"{user_file}:build")
    assert own.model["name"] == f"{user_file}:build" and own.model["args"] == {}


def test_node_model_option_is_checked_before_connecting(tmp_path):
    proc = run_cli("node", "--insecure", "--model", tmp_path / "missing.py:build", "--once",
                   check=False, timeout=120)
    assert proc.returncode == 2
    assert "missing.py does not exist here" in assert_one_error_line(proc.stderr)


# --------------------------------------------------------------------------- hf:PATH


def _tiny_vit(folder, weights=False, **extra):
    from transformers import AutoModelForImageClassification, ViTConfig

    config = ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                       intermediate_size=32, image_size=16, patch_size=4, num_channels=3,
                       **extra)
    if weights:
        AutoModelForImageClassification.from_config(config).save_pretrained(folder)
    else:
        config.save_pretrained(folder)
    return folder


def _tiny_bert(folder):
    from transformers import BertConfig

    BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
               intermediate_size=64, max_position_embeddings=32).save_pretrained(folder)
    return folder


def test_hf_image_model_rebuilds_from_its_spec_without_the_folder(tmp_path):
    folder = _tiny_vit(tmp_path / "vit")
    spec = ModelSpec.resolve(f"hf:{folder}", (1, 8, 8), 10, {"hidden_dropout_prob": 0.2})
    assert spec.args["hf_config"]["num_labels"] == 10
    assert spec.args["hf_config"]["hidden_dropout_prob"] == 0.2
    model = spec.build()
    notes = spec.check(model)
    assert "1-channel inputs repeated" in notes[0] and "resized from 8x8 to 16x16" in notes[1]
    assert "random initial weights" in notes[2]
    wire = json.loads(json.dumps(spec.as_dict()))  # what nodes and model.json get
    shutil.rmtree(folder)
    again = ModelSpec.from_dict(wire).build()
    again.load_state_dict(model.state_dict())
    x = torch.randn(3, 1, 8, 8)
    model.eval(), again.eval()
    assert torch.equal(model(x), again(x)) and model(x).shape == (3, 10)


def test_hf_initial_model_loads_the_folders_weights(tmp_path):
    from safetensors.torch import load_file

    folder = _tiny_vit(tmp_path / "vitw", weights=True)
    saved = load_file(str(folder / "model.safetensors"))
    spec = ModelSpec.resolve(f"hf:{folder}", (3, 16, 16), 4)
    key = "vit.embeddings.patch_embeddings.projection.weight"
    assert torch.equal(spec.build(initial=True).state_dict()[f"net.{key}"], saved[key])
    assert not torch.equal(spec.build().state_dict()[f"net.{key}"], saved[key])
    # weights of another architecture than config.json's: refused, not silently random
    from transformers import ResNetConfig

    other = tmp_path / "other"  # a ResNet's config.json beside a ViT's weights
    ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1]
                 ).save_pretrained(other)
    (other / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    with pytest.raises(UserError) as exc:
        ModelSpec.resolve(f"hf:{other}", (3, 16, 16), 4).build(initial=True)
    assert f"hf:{other}: model.safetensors does not fit its config.json: " in _one_line(exc)
    assert re.search(r"\d+ of the model's \d+ tensors would start random \(", _one_line(exc))
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(UserError) as exc:
        ModelSpec.resolve(f"hf:{folder}", (3, 16, 16), 4)
    assert "pytorch_model.bin, which fedavg does not load (pickle)" in _one_line(exc)


def test_hf_text_model_takes_token_ids_and_masks_padding(tmp_path):
    folder = _tiny_bert(tmp_path / "bert")
    args = {"vocab_size": 50, "pad_id": 3}
    spec = ModelSpec.resolve(f"hf:{folder}", (6,), 4, args)
    assert spec.args["hf_config"]["pad_token_id"] == 3
    model = spec.build().eval()
    assert spec.check(model) == [f"model hf:{folder}: no model.safetensors in the folder: "
                                 "random initial weights"]
    ids = torch.tensor([[5, 7, 9, 3, 3, 3], [8, 3, 3, 3, 3, 3]])
    assert ids.dtype == torch.int64 and model(ids).shape == (2, 4)
    # padded positions are masked out: the same logits as the unpadded sequences
    assert torch.allclose(model(ids)[:1], model(ids[:1, :3]), atol=1e-5)
    assert torch.allclose(model(ids)[1:], model(ids[1:, :1]), atol=1e-5)
    with pytest.raises(TypeError, match="int64 token ids"):
        model(ids.float())
    with pytest.raises(UserError) as exc:
        ModelSpec.resolve(f"hf:{folder}", (6,), 4, {"vocab_size": 61, "pad_id": 0})
    assert _one_line(exc) == (f"the data's vocabulary has 61 token ids, model hf:{folder} only "
                              "60: raise vocab_size in its config.json")
    with pytest.raises(UserError, match="cannot take token sequences of length 40"):
        ModelSpec.resolve(f"hf:{folder}", (40,), 4, args).build()


@pytest.mark.parametrize("case, words", [
    ("missing", "no such folder; pass a local Hugging Face model folder"),
    ("no-config", "has no config.json; save the model there with save_pretrained()"),
    ("bad-arg", "does not take argument 'hiden_size': hf: models take entries of their "
     "config.json; did you mean hidden_size"),
    ("no-transformers", "hf: models need the transformers package: pip install transformers"),
    ("image-as-text", "is not a text model (its config has no vocab_size)"),
    ("bad-value", "Field 'num_hidden_layers' expected int, got str (value: 'one')"),
    ("needs-timm", "ModuleNotFoundError"),  # transformers' ImportError: a traceback before
])
def test_bad_hf_models_are_one_line(tmp_path, monkeypatch, case, words):
    folder = _tiny_vit(tmp_path / "vit")
    args = {}
    if case == "missing":
        folder = tmp_path / "nope"
    elif case == "no-config":
        (folder / "config.json").unlink()
    elif case == "bad-arg":
        args = {"hiden_size": 8}
    elif case == "no-transformers":
        monkeypatch.setitem(sys.modules, "transformers", None)  # import fails
    elif case == "image-as-text":
        args = {"vocab_size": 10, "pad_id": 0}
    elif case in ("bad-value", "needs-timm"):
        config = json.loads((folder / "config.json").read_text())
        if case == "bad-value":
            config["num_hidden_layers"] = "one"
        else:  # a model type whose package cannot be imported
            monkeypatch.setitem(sys.modules, "timm", None)
            config = {"model_type": "timm_wrapper", "architecture": "resnet18"}
        (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError) as exc:
        ModelSpec.resolve(f"hf:{folder}", (3, 16, 16), 4, args).build()
    assert words in _one_line(exc)


# --------------------------------------------------------------------------- the CLI


@pytest.fixture
def invoke(tmp_path, monkeypatch):
    """Run the typer app in-process from ``tmp_path``; return (exit code, stderr line)."""
    from fedavg.cli.app import app

    monkeypatch.chdir(tmp_path)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    env = dict(os.environ)

    def _invoke(*args):
        res = CliRunner().invoke(app, [str(a) for a in args])
        assert res.exception is None or isinstance(res.exception, SystemExit), repr(
            res.exception)
        return res.exit_code, res.stdout, res.stderr

    yield _invoke
    os.environ.clear()
    os.environ.update(env)
    for sig, handler in saved.items():
        signal.signal(sig, handler)
    assert not (tmp_path / "runs").exists(), "a run folder was created"


def test_models_lists_every_form_with_an_example(invoke):
    code, out, _ = invoke("models")
    assert code == 0
    for words in ("mlp", "torchvision:NAME", "--model torchvision:mobilenet_v3_small",
                  "hf:PATH", "--model hf:models/tiny-vit", "module:function",
                  "--model my_models.py:build", "--model-arg hidden=64",
                  "needs transformers (the [hf] extra)"):
        assert words in out, words


@pytest.mark.parametrize("args, words", [
    (["--model", "mlp", "--model-arg", "hiden=3"], "model 'mlp' does not take argument "
     "'hiden' (--model-arg hiden=...); it takes: hidden"),
    (["--model-arg", "hidden"], "--model-arg takes KEY=VALUE"),
    (["--model", "mlp", "--model-arg", "hidden=0"], "model 'mlp': --model-arg hidden=0 must be "
     "a whole number >= 1 (default 200)"),  # a layer of no units: a constant model
    (["--model", "torchvision:resnet19"], "unknown torchvision model 'resnet19'"),
    (["--model", "missing_models.py:build"], "missing_models.py does not exist here"),
    (["--model", "hf:no-such-folder"], "no such folder"),
    (["--pretrained", "default"], "--pretrained takes a torchvision:NAME model"),
])
def test_model_mistakes_on_the_command_line_are_one_line(invoke, args, words):
    code, _, err = invoke("simulate", "--num-nodes", "2", "--rounds", "1", *args)
    assert code == 2
    assert words in assert_one_error_line(err)


@pytest.mark.parametrize("body, words", [
    ("return FrozenHead()", "has no trainable parameters: nodes would have nothing to train"),
    ("return IntLogits()", "gives torch.int64 logits; they must be floating point"),
    ("with torch.device('meta'):\n        return IntLogits()",
     "has its weights on the meta device (shapes, no values): build it on the CPU"),
    ("global _calls\n    _calls = globals().get('_calls', 0) + 1\n"
     "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 8 * _calls), "
     "torch.nn.Linear(8 * _calls, 10))",
     "builds another model on each call (1.bias: (8,), then (16,)): nodes must all build "
     "the same one; make the builder deterministic"),
    ("net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))\n"
     "    torch.nn.init.constant_(net[1].bias, float('nan'))\n    return net",
     "starts with NaN or infinite weights (1.bias): fix how its builder initialises them"),
])
def test_builders_nodes_could_not_train_are_refused_before_the_run(invoke, tmp_path, body,
                                                                    words):
    (tmp_path / "odd.py").write_text(
        "import torch\n"
        "class FrozenHead(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = torch.nn.Linear(64, 10).requires_grad_(False)\n"
        "    def forward(self, x):\n"
        "        return self.fc(x.flatten(1))\n"
        "class IntLogits(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = torch.nn.Linear(64, 10)\n"
        "    def forward(self, x):\n"
        "        return self.fc(x.flatten(1)).long()\n"
        f"def build(input_shape, num_classes):\n    {body}\n")
    code, _, err = invoke("simulate", "--num-nodes", "2", "--rounds", "1", "--model",
                          "odd.py:build")
    assert code == 2
    assert words in assert_one_error_line(err)


def test_merging_models_built_by_user_code_needs_the_code_named(invoke, tmp_path, user_file):
    meta = {"classes": [str(i) for i in range(10)],
            "input": {"shape": [1, 8, 8], "dtype": "uint8", "scale": 1 / 255, "mean": [0.3],
                      "std": [0.4]}}
    spec = ModelSpec.resolve(f"{user_file}:build", (1, 8, 8), 10)
    for name in ("a", "b"):
        checkpoint.save(tmp_path / name, spec.build().state_dict(),
                        {**meta, "model": spec.as_dict(), "num_examples": 10})
    args = ("merge", tmp_path / "a", tmp_path / "b", "--output", tmp_path / "m")
    code, _, err = invoke(*args)
    assert code == 2 and f"pass --model {user_file}:build to run it" in \
        assert_one_error_line(err)
    assert not (tmp_path / "m").exists()
    code, out, err = invoke(*args, "--model", f"{user_file}:build", "--dataset", "digits")
    assert code == 0, err
    assert json.loads((tmp_path / "m" / "model.json").read_text())["model"]["name"] == \
        f"{user_file}:build"


def test_coordinator_takes_model_args_too(invoke):
    code, _, err = invoke("coordinator", "--insecure", "--model", "mlp", "--model-arg", "x=1")
    assert code == 2 and "does not take argument 'x'" in assert_one_error_line(err)


def test_merging_models_of_different_architectures_is_one_line(tmp_path, user_file):
    meta = {"classes": [str(i) for i in range(10)],
            "input": {"shape": [1, 8, 8], "dtype": "uint8", "scale": 1 / 255, "mean": [0.3],
                      "std": [0.4]}}
    one = ModelSpec.resolve("torchvision:mobilenet_v3_small", (1, 8, 8), 10)
    two = ModelSpec.resolve(f"{user_file}:build", (1, 8, 8), 10)
    checkpoint.save(tmp_path / "a", one.build().state_dict(), {**meta, "model": one.as_dict()})
    checkpoint.save(tmp_path / "b", two.build().state_dict(), {**meta, "model": two.as_dict()})
    proc = run_cli("merge", tmp_path / "a", tmp_path / "b", "--output", tmp_path / "m",
                   check=False, timeout=120)
    assert proc.returncode == 2
    line = assert_one_error_line(proc.stderr)
    assert "differs from" in line and "'model'" in line and "share architecture" in line
    assert not (tmp_path / "m").exists()


# --------------------------------------------------------------------------- end to end


def _summary(out):
    return json.loads((out / "summary.json").read_text())


@pytest.mark.e2e
def test_torchvision_model_on_digits_then_predict_and_evaluate(tmp_path, no_leaks):
    out = tmp_path / "tv"
    proc = run_cli("simulate", "--model", "torchvision:resnet18", "--num-nodes", "2",
                   "--rounds", "2", "--lr", "0.02", "--output", out)
    assert "1-channel inputs repeated to the model's 3 channels" in proc.stdout
    meta = json.loads((out / "model.json").read_text())
    assert meta["model"]["name"] == "torchvision:resnet18"
    assert any("repeated" in n for n in meta["dataset"]["notes"])
    summary = _summary(out)
    assert summary["rounds"] == 2 and summary["accuracy"] > 0.25, summary  # chance is 0.1
    ev = json.loads(run_cli("evaluate", out, "--json").stdout)
    assert ev["accuracy"] == pytest.approx(summary["accuracy"], abs=1e-6)
    preds = tmp_path / "p.json"
    run_cli("predict", out, "digits", "--output", preds)
    rows = json.loads(preds.read_text())
    assert len(rows) == ev["num_examples"] == 359
    from fedavg.data.load import load

    labels = load("digits").test.y
    acc = sum(int(r["prediction"]) == y for r, y in zip(rows, labels)) / len(rows)
    assert acc == pytest.approx(summary["accuracy"], abs=1e-6)


@pytest.mark.e2e
def test_user_module_with_model_args_on_digits(tmp_path, user_file, no_leaks):
    out = tmp_path / "own"
    proc = _run_in(tmp_path, "simulate", "--model", "my_models.py:build", "--model-arg",
                   "hidden=24", "--num-nodes", "3", "--rounds", "2", "--local-epochs", "3",
                   "--output", out)
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((out / "model.json").read_text())
    assert meta["model"]["name"] == f"{user_file}:build"  # absolute
    assert meta["model"]["args"] == {"hidden": 24}
    assert meta["config"]["train"]["model_args"] == {"hidden": 24}
    state, _ = checkpoint.load(out)
    assert state["mid.weight"].shape == (24, 24)
    assert torch.equal(state["mid.weight"], state["mid2.weight"])  # tied through the merge
    assert state["steps"].dtype == torch.int64 and int(state["steps"]) > 0
    summary = _summary(out)
    assert summary["accuracy"] > 0.6, summary
    ev = json.loads(run_cli("evaluate", out, "--json", "--model", f"{user_file}:build")
                    .stdout)  # from another folder, the code named (as nodes name it)
    assert ev["accuracy"] == pytest.approx(summary["accuracy"], abs=1e-6)
    # --resume: the model args may not change
    bad = _run_in(tmp_path, "simulate", "--resume", out, "--rounds", "3", "--model-arg",
                  "hidden=8")
    assert bad.returncode == 2
    assert '--model-arg {"hidden": 8} differs' in assert_one_error_line(bad.stderr)


def _run_in(cwd, *args):
    import subprocess

    from helpers.cli import ROOT

    return subprocess.run([sys.executable, "-m", "fedavg.cli", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLUMNS": "120", "PYTHONPATH": str(ROOT)})


@pytest.mark.e2e
def test_tiny_hf_image_model_on_digits(tmp_path, no_leaks):
    from transformers import AutoModelForImageClassification, ResNetConfig

    folder = tmp_path / "tiny-resnet"
    config = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                          num_channels=3, num_labels=3)
    AutoModelForImageClassification.from_config(config).save_pretrained(folder)
    out = tmp_path / "hf"
    proc = run_cli("simulate", "--model", f"hf:{folder}", "--num-nodes", "2", "--rounds", "2",
                   "--local-epochs", "2", "--output", out)
    assert "1-channel inputs repeated to the model's 3 channels" in proc.stdout
    assert "the initial model loads model.safetensors" in proc.stdout
    meta = json.loads((out / "model.json").read_text())
    assert meta["model"]["args"]["hf_config"]["model_type"] == "resnet"
    assert meta["model"]["args"]["hf_config"]["num_labels"] == 10
    state, _ = checkpoint.load(out)
    counters = [k for k in state if k.endswith("num_batches_tracked")]
    assert counters and all(state[k].dtype == torch.int64 and int(state[k]) > 0 for k in counters)
    shutil.rmtree(folder)  # predict and evaluate need only the run folder
    summary = _summary(out)
    assert summary["accuracy"] > 0.5, summary  # chance is 0.1
    ev = json.loads(run_cli("evaluate", out, "--json").stdout)
    assert ev["accuracy"] == pytest.approx(summary["accuracy"], abs=1e-6)
    preds = tmp_path / "p.csv"
    run_cli("predict", out, "digits", "--output", preds)
    assert len(preds.read_text().splitlines()) == 360  # header + 359 held-out digits


EVAL_FAILS = """import sys
from torch import nn


class Net(nn.Module):
    def __init__(self, k, how):
        super().__init__()
        self.fc, self.how = nn.Linear(64, k), how

    def forward(self, x):
        if not self.training and x.shape[0] > 2:  # the start-up check's batch of 2 passes
            if self.how == "raise":
                raise ValueError("eval-time failure")
            if self.how == "exit":
                sys.exit(5)
            return self.fc(x.flatten(1)) * float("nan")
        return self.fc(x.flatten(1))


def build(input_shape, num_classes, how="raise"):
    return Net(num_classes, how)
"""


@pytest.mark.e2e
def test_model_code_failing_in_the_coordinators_evaluation_is_one_line(tmp_path, no_leaks):
    """It was a traceback (raise) or a silent exit with the model's code (sys.exit)."""
    (tmp_path / "net.py").write_text(EVAL_FAILS)
    for how, said in (("raise", "ValueError: eval-time failure"), ("exit", "SystemExit: 5")):
        proc = run_cli("simulate", "--model", f"{tmp_path / 'net.py'}:build", "--model-arg",
                       f"how={how}", "--num-nodes", "2", "--rounds", "1", "--output",
                       tmp_path / how, check=False)
        assert proc.returncode == 1, proc.stderr
        assert "Traceback" not in proc.stderr
        assert proc.stderr.strip() == (f"run failed: round 1's merged model failed on the test "
                                       f"data, in eval mode ({said}): fix the model's forward")
    # NaN logits: the run ends, its table and summary say nan / null (a crash after the run)
    proc = run_cli("simulate", "--model", f"{tmp_path / 'net.py'}:build", "--model-arg",
                   "how=nan", "--num-nodes", "2", "--rounds", "1", "--output", tmp_path / "nan")
    assert "loss nan" in proc.stdout and "Traceback" not in proc.stderr
    assert _summary(tmp_path / "nan")["loss"] is None
    ev = run_cli("evaluate", tmp_path / "nan", "--json", "--model",
                 f"{tmp_path / 'net.py'}:build").stdout
    assert json.loads(ev)["loss"] is None  # null, not NaN (no JSON)


def test_weights_nodes_cannot_send_are_refused_at_the_start():
    """bfloat16 weights and non-tensor extra state failed in Flower's arrays: a traceback."""
    from fedavg.models.sources import check_output

    half = nn.Sequential(nn.Flatten(), nn.Linear(64, 10).to(torch.bfloat16))
    with pytest.raises(UserError, match=r"has bfloat16 weights \(1\.weight\).*float32"):
        check_output(half, (1, 8, 8), 10, "half")
    double = nn.Sequential(nn.Flatten(), nn.Linear(64, 10)).double()  # was torch's "mat1
    with pytest.raises(UserError, match=r"has float64 weights \(1\.weight\), but its inputs "
                                        r"come as float32: build it in float32"):  # and mat2"
        check_output(double, (1, 8, 8), 10, "double")

    class Extra(nn.Sequential):
        def get_extra_state(self):
            return {"v": 1}

        def set_extra_state(self, state):
            pass

    extra = Extra(nn.Flatten(), nn.Linear(64, 10))
    with pytest.raises(UserError, match=r"state that is no tensor \(_extra_state, from "
                                        r"get_extra_state\).*keep it in a buffer"):
        check_output(extra, (1, 8, 8), 10, "extra")
    check_output(nn.Sequential(nn.Flatten(), nn.Linear(64, 10)), (1, 8, 8), 10, "plain")
