"""Text data: tokenizers, text column detection, the text models, and checks of input kinds."""

import json
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch
from helpers.cli import SHARED_DATA

from fedavg.data.text import FileTokenizer, HashedTokenizer, from_spec, make_tokenizer
from fedavg.util.errors import UserError

AG_NEWS = SHARED_DATA / "ag_news"


def test_hashed_ids_are_crc32_buckets_hand_computed():
    # crc32(b"hello") = 0x3610A686 = 907060870; 907060870 % 9 = 1 (digit sum 37): id 1 + 1
    assert zlib.crc32(b"hello") == 907060870
    tok = HashedTokenizer(buckets=10, max_length=4, ngrams=1)
    assert tok.ids("Hello") == [2]
    assert tok.ids("HELLO hello") == [2, 2]  # lower-cased
    assert tok.encode(["hello"]).tolist() == [[2, 0, 0, 0]]  # padded with 0


def test_hashed_words_then_bigrams_cut_to_max_length():
    tok = HashedTokenizer(buckets=1000, max_length=5)
    words = HashedTokenizer(buckets=1000, ngrams=1)
    ids = tok.ids("a b, c")  # words a b , c; bigrams "a b" "b ," ", c"
    assert ids[:4] == words.ids("a b, c") and len(ids) == 7
    assert all(1 <= i < 1000 for i in ids)
    assert tok.encode(["a b, c"])[0].tolist() == ids[:5]
    assert tok.encode(["", None]).tolist() == [[0] * 5, [0] * 5]


def test_hashed_ids_are_the_same_in_another_process():
    text = "Stocks rally as the Fed holds rates"
    here = HashedTokenizer().ids(text)
    code = f"from fedavg.data.text import HashedTokenizer; print(HashedTokenizer().ids({text!r}))"
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={"PYTHONHASHSEED": "123"}).stdout
    assert json.loads(there) == here


@pytest.mark.parametrize("kwargs, flag", [({"buckets": 1}, "--hash-buckets"),
                                          ({"max_length": 0}, "--max-tokens")])
def test_hashed_settings_out_of_range(kwargs, flag):
    with pytest.raises(UserError, match=flag):
        HashedTokenizer(**kwargs)


def _word_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "[PAD]"])
    tok.train_from_iterator(["the cat sat", "the dog ran", "a cat ran"], trainer)
    path = tmp_path / "words.json"
    tok.save(str(path))
    return path, tok


def test_file_tokenizer_pads_with_its_pad_id_and_round_trips(tmp_path):
    path, raw = _word_tokenizer_json(tmp_path)
    tok = make_tokenizer(str(path), max_length=4)
    assert isinstance(tok, FileTokenizer) and tok.pad_id == raw.token_to_id("[PAD]") == 1
    ids = tok.encode(["the cat ran", "zebra"])
    the, cat, ran = (raw.token_to_id(w) for w in ("the", "cat", "ran"))
    assert ids.tolist() == [[the, cat, ran, 1], [0, 1, 1, 1]]  # zebra is [UNK] = 0
    run = tmp_path / "run"
    tok.save(run)
    again = from_spec(tok.spec(), run)
    assert again.encode(["the cat ran"]).tolist() == ids[:1].tolist()
    (run / "tokenizer.json").write_text(path.read_text().replace('"cat"', '"cot"'))
    with pytest.raises(UserError, match="SHA-256"):
        from_spec(tok.spec(), run)
    (run / "tokenizer.json").unlink()
    with pytest.raises(UserError, match="missing"):
        from_spec(tok.spec(), run)


def test_a_tokenizer_without_a_pad_token_pads_with_an_id_of_its_own(tmp_path):
    """Id 0 padded, and is a real word (here [UNK]): the models ignored that word."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    raw = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator(["oil price up", "team wins cup"],
                            trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    path = tmp_path / "nopad.json"
    raw.save(str(path))
    tok = make_tokenizer(str(path), max_length=4)
    words = raw.get_vocab_size(with_added_tokens=True)  # 7: [UNK] and six words
    assert (tok.pad_id, tok.vocab_size) == (words, words + 1)  # one past the vocabulary
    oil = raw.token_to_id("oil")
    assert tok.encode(["oil zebra"]).tolist() == [[oil, 0, words, words]]  # zebra: [UNK]
    tok.save(tmp_path / "run")
    again = from_spec(tok.spec(), tmp_path / "run")
    assert (again.pad_id, again.vocab_size) == (words, words + 1)
    old = {**tok.spec(), "pad_id": 0, "vocab_size": words}  # a run saved before: kept as it was
    assert from_spec(old, tmp_path / "run").encode(["oil"]).tolist() == [[oil, 0, 0, 0]]


def test_a_transformers_tokenizer_folder_tokenizes_as_transformers_does(tmp_path):
    from transformers import AutoTokenizer, BertTokenizer

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat",
                                "sat", "dog", "ran", "##s"]) + "\n")
    folder = tmp_path / "bert-tok"
    BertTokenizer(str(vocab)).save_pretrained(str(folder))
    (folder / "tokenizer.json").unlink(missing_ok=True)  # vocab.txt and config only (some
    (folder / "vocab.txt").write_text(vocab.read_text())  # versions save no vocab.txt)
    ours = make_tokenizer(str(folder), max_length=8)
    theirs = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    text = "The cats ran, the dog sat"
    want = theirs(text, padding="max_length", max_length=8, truncation=True)["input_ids"]
    assert ours.encode([text]).tolist() == [want]
    assert want[0] == 2 and ours.pad_id == 0  # [CLS] first; [PAD] is id 0
    assert want[1:3] == [5, 6]  # "the", "cat": words of the vocabulary, not [UNK]


@pytest.mark.parametrize("name, match", [("no/such/tokenizer.json", "no such file"),
                                         ("BROKEN", "not a tokenizers JSON")])
def test_bad_tokenizer_paths_say_what_to_fix(tmp_path, name, match):
    if name == "BROKEN":
        name = str(tmp_path / "t.json")
        (tmp_path / "t.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(UserError, match=match):
        make_tokenizer(name)


def test_ag_news_is_detected_as_text_and_tokenized():
    from fedavg.data.load import load

    data = load(str(AG_NEWS), max_tokens=64)
    assert data.kind == "text" and data.columns == {"text": "text", "label": "label"}
    assert data.classes == ["world", "sports", "business", "tech"]
    assert data.train.x.shape == (5000, 64) and data.train.x.dtype == np.int64
    spec = data.input_spec()
    assert spec["kind"] == "text" and spec["shape"] == [64] and spec["pad_id"] == 0
    assert spec["tokenizer"] == {"kind": "hashed", "buckets": 131072, "max_length": 64,
                                 "ngrams": 2}
    first = data.train.x[0][data.train.x[0] > 0]
    assert len(first) > 10  # a news title and description


def test_text_column_override_and_its_errors(tmp_path):
    import pandas as pd

    from fedavg.data.load import load

    csv = tmp_path / "t.csv"
    pd.DataFrame({"title": [f"a {'good' if i % 2 else 'bad'} day, the {i}th" for i in range(10)],
                  "body": [f"text {i}" for i in range(10)],
                  "n": list(range(10)), "label": [0, 1] * 5}).to_csv(csv, index=False)
    data = load(str(csv))
    assert data.columns["text"] == "title"  # the first string column of text, and said so
    assert "text column 'title', chosen among the string columns; --text-column to take " \
        "another (body)" in data.notes
    labelled = tmp_path / "s.csv"  # a string label is not another text column to offer
    pd.DataFrame({"title": [f"a {'good' if i % 2 else 'bad'} day" for i in range(10)],
                  "label": ["neg", "pos"] * 5}).to_csv(labelled, index=False)
    assert not any("string columns" in n for n in load(str(labelled)).notes)
    chosen = load(str(csv), text_column="body")
    assert chosen.columns["text"] == "body" and not any("string columns" in n
                                                         for n in chosen.notes)
    with pytest.raises(UserError, match="--image-column title: it holds text; pass "
                                        "--text-column title"):
        load(str(csv), image_column="title")  # it trained a text model, ignoring the flag
    empty = tmp_path / "empty.csv"
    pd.DataFrame({"text": [""] * 4, "label": [0, 1] * 2}).to_csv(empty, index=False)
    with pytest.raises(UserError, match="column 'text' of .* is empty: every value is missing"):
        load(str(empty))
    with pytest.raises(UserError, match="--text-column n: it holds"):
        load(str(csv), text_column="n")
    with pytest.raises(UserError, match="--text-column"):
        load(str(csv), text_column="nope")


def test_bag_of_embeddings_sums_token_vectors_and_ignores_padding():
    from fedavg.models.text import BagOfEmbeddings

    net = BagOfEmbeddings(vocab_size=5, num_classes=2, pad_id=0, dim=3)
    with torch.no_grad():
        net.embedding.weight.copy_(torch.arange(15, dtype=torch.float32).view(5, 3))
        net.embedding.weight[0].zero_()
        net.fc.weight.copy_(torch.tensor([[1.0, 0, 0], [0, 0, 1.0]]))
        net.fc.bias.zero_()
    # ids 1 and 2: rows [3, 4, 5] + [6, 7, 8] = [9, 11, 13]; logits [9, 13]
    out = net(torch.tensor([[1, 2, 0, 0]]))
    assert out.tolist() == [[9.0, 13.0]]
    out.sum().backward()
    assert net.embedding.weight.grad[0].abs().sum() == 0  # padding is never trained


def test_text_transformer_ignores_padding():
    from fedavg.models.text import TextTransformer

    torch.manual_seed(0)
    net = TextTransformer(vocab_size=50, max_length=8, num_classes=3).eval()
    short = torch.tensor([[5, 6, 7, 0, 0, 0]])
    longer = torch.tensor([[5, 6, 7, 0, 0, 0, 0, 0]])
    assert net(short).shape == (1, 3)
    torch.testing.assert_close(net(short), net(longer))


def test_image_models_refuse_text_and_text_models_refuse_images():
    from fedavg.models.registry import build_model, resolve_model

    assert resolve_model("auto", (256,), "text") == "fasttext"
    with pytest.raises(UserError, match="takes image inputs, and this data is text"):
        resolve_model("cnn", (256,), "text")
    with pytest.raises(UserError, match="takes text inputs, and this data is image"):
        resolve_model("fasttext", (1, 8, 8), "image")
    net = build_model("text-transformer", (16,), 4, vocab_size=100, pad_id=0)
    assert net(torch.zeros(2, 16, dtype=torch.long)).shape == (2, 4)


def test_check_kind_names_both_kinds_and_tokenizer_differences():
    from fedavg.data.load import check_kind, load

    digits = load("digits")
    text = load(str(AG_NEWS), max_tokens=32)
    with pytest.raises(UserError, match="takes text inputs, and digits is image"):
        check_kind(text.input_spec(), digits, "digits")
    with pytest.raises(UserError, match="takes image inputs, and ag is text"):
        check_kind(digits.input_spec(), text, "ag")
    other = load(str(AG_NEWS), max_tokens=32, hash_buckets=1000)
    with pytest.raises(UserError, match="tokenized differently.*buckets 131072 vs 1000"):
        check_kind(text.input_spec(), other, "ag")
    check_kind(text.input_spec(), text, "ag")  # alike: no error


def test_a_damaged_text_input_description_is_one_line():
    from fedavg.run.checkpoint import _meta_problem

    spec = {"kind": "text", "shape": [8], "dtype": "int64", "vocab_size": 10, "pad_id": 0,
            "tokenizer": {"kind": "hashed", "buckets": 10, "max_length": 8, "ngrams": 2}}
    meta = {"model": {"name": "fasttext", "num_classes": 2, "input_shape": [8]},
            "classes": ["a", "b"], "input": spec}
    assert _meta_problem(meta) is None
    assert "max_length" in _meta_problem({**meta, "input": {**spec, "shape": [9]}})
    assert "tokenizer" in _meta_problem({**meta, "input": {**spec, "tokenizer": "x"}})


def test_cli_refuses_an_image_model_for_text_in_one_line(tmp_path):
    from helpers.cli import assert_one_error_line, run_cli

    proc = run_cli("simulate", "--dataset", AG_NEWS, "--model", "cnn", "--output",
                   tmp_path / "run", check=False)
    assert proc.returncode == 2
    line = assert_one_error_line(proc.stderr)
    assert "model 'cnn' takes image inputs, and this data is text" in line
    assert "fasttext" in line and not (tmp_path / "run").exists()
    proc = run_cli("simulate", "--dataset", AG_NEWS, "--tokenizer", tmp_path / "none.json",
                   "--output", tmp_path / "run", check=False)
    assert proc.returncode == 2 and "no such file" in assert_one_error_line(proc.stderr)


def test_cli_predict_text_with_an_image_model_is_one_line(tmp_path):
    from helpers.cli import assert_one_error_line, run_cli

    from fedavg.data.load import load
    from fedavg.models.registry import build_model
    from fedavg.run import checkpoint

    data = load("digits")
    net = build_model("mlp", data.input_shape, 10)
    checkpoint.save(tmp_path / "m", net.state_dict(), {
        "model": {"name": "mlp", "input_shape": [1, 8, 8], "num_classes": 10, "args": {}},
        "classes": data.classes, "input": data.input_spec()})
    proc = run_cli("predict", tmp_path / "m", "some words", "--text", check=False)
    assert proc.returncode == 2
    assert "takes image inputs, not text" in assert_one_error_line(proc.stderr)


def _text_model_folders(tmp_path, data, count=2):
    from fedavg.models.registry import ModelSpec
    from fedavg.run import checkpoint
    from fedavg.run.lifecycle import text_model_args

    spec = ModelSpec("fasttext", data.input_shape, len(data.classes), text_model_args(data))
    folders = []
    for i in range(count):
        torch.manual_seed(i)
        folder = tmp_path / f"node-{i}"
        checkpoint.save(folder, spec.build().state_dict(), {
            "model": spec.as_dict(), "classes": data.classes, "input": data.input_spec(),
            "dataset": {"source": str(AG_NEWS), "seed": 0, "columns": data.columns}})
        folders.append(folder)
    return folders


def test_merging_text_models_keeps_their_tokenizer_file(tmp_path):
    from fedavg.config.settings import RunConfig
    from fedavg.data.load import load
    from fedavg.use.inference import load_model
    from fedavg.use.merge import merge_models

    path, _ = _word_tokenizer_json(tmp_path)
    data = load(str(AG_NEWS), tokenizer=str(path), max_tokens=16)
    folders = _text_model_folders(tmp_path, data)
    assert all((f / "tokenizer.json").read_text() == path.read_text() for f in folders)
    out = tmp_path / "merged"
    merge_models(folders, out, RunConfig().replace(strategy="average"))
    assert (out / "tokenizer.json").read_text() == path.read_text()
    a, b = (load_model(f).embedding.weight for f in folders)
    torch.testing.assert_close(load_model(out).embedding.weight, (a + b) / 2)


def test_distilling_text_models_on_unlabeled_texts(tmp_path):
    from fedavg.config.settings import RunConfig
    from fedavg.data.load import load
    from fedavg.use.merge import merge_models

    data = load(str(AG_NEWS), max_tokens=32, hash_buckets=4096)
    folders = _text_model_folders(tmp_path, data)
    config = RunConfig().replace(strategy="distill", distill_data=str(AG_NEWS),
                                 validation=str(AG_NEWS),
                                 distill_steps=5, distill_batch_size=16)
    result = merge_models(folders, tmp_path / "student", config, dataset=str(AG_NEWS))
    assert result["num_models"] == 2 and 0 <= result["accuracy"] <= 1
    meta = json.loads((tmp_path / "student" / "model.json").read_text())
    assert meta["input"]["tokenizer"]["buckets"] == 4096


def test_predict_text_notes_an_input_that_is_a_file(tmp_path):
    from fedavg.data.load import load
    from fedavg.use.inference import predict

    data = load(str(AG_NEWS), max_tokens=16, hash_buckets=512)
    (folder,) = _text_model_folders(tmp_path, data, count=1)
    lines = tmp_path / "news.txt"
    lines.write_text("stocks fall\nteam wins\n")
    notes = []
    rows = predict(folder, [str(lines), "stocks fall"], text=True, on_note=notes.append)
    assert [r["input"] for r in rows] == [str(lines), "stocks fall"]
    assert len(notes) == 1 and "is a file, classified as the text of its name" in notes[0]
    rows = predict(folder, [str(lines)], on_note=notes.append)  # without --text: its lines
    assert [r["input"] for r in rows] == ["stocks fall", "team wins"] and len(notes) == 1


def test_a_tokenizer_without_vocabulary_and_too_many_tokens_are_refused(tmp_path):
    from tokenizers import Tokenizer, models

    empty = tmp_path / "empty.json"
    Tokenizer(models.WordLevel(unk_token="[UNK]")).save(str(empty))
    with pytest.raises(UserError, match="has no vocabulary"):
        make_tokenizer(str(empty))
    # what a model folder's config alone gives: [PAD], [UNK], [CLS], [SEP], [MASK] and no words
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    only_special = Tokenizer(models.WordPiece({t: i for i, t in enumerate(specials)},
                                              unk_token="[UNK]"))
    only_special.add_special_tokens(specials)
    only_special.save(str(empty))
    with pytest.raises(UserError, match=r"has no vocabulary \(only 0 word\(s\) beside its "):
        make_tokenizer(str(empty))
    only_special.add_tokens(["stocks", "team"])  # two words: enough to tell texts apart
    only_special.save(str(empty))
    assert make_tokenizer(str(empty)).vocab_size == 7
    with pytest.raises(UserError, match=r"--max-tokens must be in 1\.\.8192"):
        HashedTokenizer(max_length=10**20)
    from fedavg.config.settings import RunConfig

    with pytest.raises(UserError, match=r"--max-tokens must be in 1\.\.8192"):
        RunConfig().replace(max_tokens=100_000_000).validate()


def test_tampered_text_descriptions_say_the_artifact_is_damaged():
    from fedavg.run.checkpoint import _meta_problem

    spec = {"kind": "text", "shape": [8], "dtype": "int64", "vocab_size": 10, "pad_id": 0,
            "tokenizer": {"kind": "hashed", "buckets": 10, "max_length": 8, "ngrams": 2}}
    model = {"name": "fasttext", "num_classes": 2, "input_shape": [8],
             "args": {"vocab_size": 10, "pad_id": 0}}
    meta = {"model": model, "classes": ["a", "b"], "input": spec}
    assert _meta_problem(meta) is None
    bigger = {**spec, "tokenizer": {**spec["tokenizer"], "buckets": 10**7}}
    assert "buckets" in _meta_problem({**meta, "input": bigger})
    assert "pad_id" in _meta_problem({**meta, "input": {**spec, "pad_id": 99999}})
    other = {**model, "args": {"vocab_size": 10, "pad_id": 3}}
    assert "model.args.pad_id" in _meta_problem({**meta, "model": other})
    with pytest.raises(UserError, match="damaged"):
        from_spec({"kind": "hashed", "buckets": "x", "max_length": 8})


def test_bad_builder_arguments_of_built_in_models_are_one_line():
    from fedavg.models.registry import build_model

    for args, words in (({"hidden": "abc"}, "--model-arg hidden='abc' must be a whole number"),
                        ({"dim": 0}, "--model-arg dim=0 must be a whole number >= 1")):
        name, shape = ("mlp", (1, 8, 8)) if "hidden" in args else ("fasttext", (8,))
        extra = {} if name == "mlp" else {"vocab_size": 10, "pad_id": 0}
        with pytest.raises(UserError, match=words.replace("{", r"\{").replace("}", r"\}")):
            build_model(name, shape, 2, **args, **extra)
    with pytest.raises(UserError, match="cannot be built with"):
        build_model("text-transformer", (8,), 2, vocab_size=10, heads=3)


def test_vocab_size_and_pad_id_come_from_the_tokenizer():
    from fedavg.config.settings import RunConfig
    from fedavg.run.lifecycle import prepare

    config = RunConfig().replace(dataset=str(AG_NEWS), max_tokens=16, hash_buckets=256,
                                 num_nodes=2, model_args={"vocab_size": 5})
    with pytest.raises(UserError, match="--model-arg vocab_size: for text these come from"):
        prepare(config)


def test_resume_refuses_texts_tokenized_otherwise(tmp_path):
    from fedavg.run.resume_checks import check_same_data

    spec = {"kind": "text", "tokenizer": {"kind": "file", "sha256": "aa", "max_length": 8}}
    (tmp_path / "model.json").write_text(json.dumps({"input": spec}))
    check_same_data(tmp_path, spec)  # the same: fine
    changed = {**spec, "tokenizer": {**spec["tokenizer"], "sha256": "bb"}}
    with pytest.raises(UserError, match="tokenized otherwise.*sha256 'aa' vs 'bb'"):
        check_same_data(tmp_path, changed)


def test_text_that_is_not_utf8_is_one_line(tmp_path):
    from fedavg.data.load import load

    bad = tmp_path / "t.jsonl"
    bad.write_bytes(b'{"text": "caf\xe9 au lait", "label": 0}\n{"text": "tea", "label": 1}\n'
                    * 3)
    with pytest.raises(UserError) as caught:
        load(str(bad))
    assert "\n" not in str(caught.value)


def test_evaluate_takes_a_text_column_of_another_dataset(tmp_path):
    """`evaluate` and `predict` had no --text-column, though errors told users to pass one."""
    import pandas as pd
    from typer.testing import CliRunner

    from fedavg.cli.app import app
    from fedavg.data.load import load
    from fedavg.use.inference import evaluate_model

    data = load(str(AG_NEWS), max_tokens=32, hash_buckets=4096)
    folder = _text_model_folders(tmp_path, data, count=1)[0]
    test = pd.read_parquet(AG_NEWS / "test.parquet")
    table = tmp_path / "news.csv"  # the news in "story"; "note", another text column, first
    pd.DataFrame({"note": [f"seen by reader {i} on day {i % 7}" for i in range(len(test))],
                  "story": test["text"], "label": [data.classes[i] for i in test["label"]]}
                 ).to_csv(table, index=False)
    own = evaluate_model(folder)  # AG News's own test split, its text column "text"
    picked = evaluate_model(folder, str(table), text_column="story")
    assert picked["num_examples"] == own["num_examples"] == len(test)
    assert picked["loss"] == pytest.approx(own["loss"], rel=1e-5)
    assert picked["accuracy"] == pytest.approx(own["accuracy"])
    detected = evaluate_model(folder, str(table))  # the first text column: the notes
    assert detected["loss"] != pytest.approx(own["loss"], rel=1e-6)  # other tokens
    named = tmp_path / "named.csv"  # a column named as the run's ("text"), second: taken
    pd.read_csv(table).rename(columns={"story": "text"}).to_csv(named, index=False)
    assert evaluate_model(folder, str(named))["loss"] == pytest.approx(own["loss"], rel=1e-5)
    from fedavg.use.inference import predict

    expected = [r["prediction"] for r in predict(folder, [str(AG_NEWS)])]
    assert [r["prediction"] for r in predict(folder, [str(named)])] == expected
    assert [r["prediction"] for r in predict(folder, [str(table)])] != expected  # "note"
    assert [r["prediction"] for r in predict(folder, [str(table)], text_column="story")] == \
        expected
    res = CliRunner().invoke(app, ["predict", str(folder), str(table), "--text-column",
                                   "story", "--output", "-"])
    assert res.exit_code == 0, res.output
    assert [line.split(",")[1] for line in res.stdout.splitlines()[1:]] == expected
    unlabelled = tmp_path / "unlabelled.csv"  # was: "a dataset input needs a label column"
    pd.read_csv(table).drop(columns="label").to_csv(unlabelled, index=False)
    assert [r["prediction"] for r in predict(folder, [str(unlabelled)],
                                             text_column="story")] == expected
    assert [r["input"] for r in predict(folder, [str(unlabelled)], text_column="story")][:2] \
        == [f"{unlabelled}#row0", f"{unlabelled}#row1"]
    named_unlabelled = tmp_path / "named_unlabelled.csv"  # the run's column, "text": taken
    pd.read_csv(named).drop(columns="label").to_csv(named_unlabelled, index=False)
    assert [r["prediction"] for r in predict(folder, [str(named_unlabelled)])] == expected
    with pytest.raises(UserError, match="--text-column nope: .* has no such column; columns "
                                        "are: note, story"):
        predict(folder, [str(unlabelled)], text_column="nope")
    headed = tmp_path / "headed.csv"  # the texts under a label's name: named, they are input
    pd.DataFrame({"class": pd.read_csv(unlabelled)["story"]}).to_csv(headed, index=False)
    assert [r["prediction"] for r in predict(folder, [str(headed)], text_column="class")] == \
        expected  # was: "column 'class' is both the input and the label; pass ... --label-column"
    notes = []  # with no dataset input nothing takes the column: said, not silent
    predict(folder, ["oil prices rise"], text=True, text_column="story", on_note=notes.append)
    assert notes == ["--text-column only chooses the input column of dataset inputs; none of "
                     "these inputs is one, so it is not used"]
    notes.clear()
    predict(folder, [str(unlabelled)], text_column="story", on_note=notes.append)
    assert notes == []
    res = CliRunner().invoke(app, ["evaluate", str(folder), "--dataset", str(table),
                                   "--text-column", "story", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["loss"] == pytest.approx(own["loss"], rel=1e-5)
    res = CliRunner().invoke(app, ["evaluate", str(folder), "--dataset", str(table),
                                   "--text-column", "nope"])
    assert res.exit_code == 2 and "--text-column" in res.output and "story" in res.output


def test_a_txt_file_with_a_byte_order_mark_reads_its_first_text_as_written(tmp_path):
    """Notepad's UTF-8 files start with a byte order mark; it was kept in the first text."""
    from fedavg.data.text import text_inputs

    path = tmp_path / "news.txt"
    path.write_bytes("oil price up\n\nteam wins\n".encode("utf-8-sig"))
    assert text_inputs([str(path)], literal=False) == [("text", "oil price up"),
                                                       ("text", "team wins")]


def test_empty_texts_are_noted_with_their_share(tmp_path):
    from fedavg.data.load import load

    rows = ["text,label"] + [("" if i % 5 == 0 else f"words of text {i}") + f",{'ab'[i % 2]}"
                             for i in range(50)]
    (tmp_path / "train.csv").write_text("\n".join(rows) + "\n")
    data = load(str(tmp_path / "train.csv"))
    said = [n for n in data.notes if "texts (20%) in column 'text'" in n]
    assert said and said[0].startswith("10 of 50 texts"), data.notes
    full = tmp_path / "full.csv"
    full.write_text("\n".join(r for r in rows if not r.startswith(",")) + "\n")
    assert not any("are empty" in n for n in load(str(full)).notes)
