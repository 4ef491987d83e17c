"""End-to-end text classification: the real CLI on AG News from ../shared/data."""

import csv
import json

import pytest
from conftest import SHARED_DATA, assert_one_error_line, run_cli

pytestmark = pytest.mark.e2e

AG_NEWS = SHARED_DATA / "ag_news"
SPORTS = "The Yankees beat the Red Sox 7-2 as their pitcher threw a shutout in the playoff game"


def _predict_texts(run, *texts):
    proc = run_cli("predict", run, *texts, "--text", "--output", run / "pred.json")
    assert "prediction(s) written" in proc.stdout
    return json.loads((run / "pred.json").read_text())


def test_ag_news_federated_with_the_default_text_model_then_predict(tmp_path, no_leaks):
    out = tmp_path / "run"
    run_cli("simulate", "--dataset", AG_NEWS, "--num-nodes", "3", "--rounds", "2",
            "--local-epochs", "2", "--lr", "0.02", "--output", out)
    meta = json.loads((out / "model.json").read_text())
    assert meta["model"]["name"] == "fasttext"
    assert meta["model"]["args"] == {"vocab_size": 131072, "pad_id": 0}
    assert meta["input"]["kind"] == "text" and meta["input"]["tokenizer"]["kind"] == "hashed"
    assert meta["dataset"]["columns"] == {"text": "text", "label": "label"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accuracy"] > 0.6, summary  # 4 classes: chance is 0.25

    (row,) = _predict_texts(out, SPORTS)
    assert row["prediction"] == "sports" and 0.25 < row["confidence"] <= 1
    lines = tmp_path / "news.txt"
    lines.write_text(f"{SPORTS}\n\nOil prices climb as stocks slide on Wall Street\n")
    run_cli("predict", out, lines, "--output", tmp_path / "p.csv")
    with open(tmp_path / "p.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["input"] for r in rows] == [SPORTS, "Oil prices climb as stocks slide on "
                                          "Wall Street"]  # the empty line is skipped
    ev = json.loads(run_cli("evaluate", out, "--json").stdout)
    assert ev["accuracy"] == pytest.approx(summary["accuracy"], abs=1e-3)
    assert ev["num_examples"] == 1000

    # text to an image model, and images to the text model: one line, exit 2
    proc = run_cli("evaluate", out, "--dataset", "digits", check=False)
    assert proc.returncode == 2
    assert "takes text inputs, and digits is image" in assert_one_error_line(proc.stderr)
    png = tmp_path / "x.png"
    from PIL import Image

    Image.new("L", (8, 8)).save(png)
    proc = run_cli("predict", out, png, check=False)
    assert proc.returncode == 2 and "this model takes text" in assert_one_error_line(proc.stderr)


def test_one_shot_ensemble_of_text_models_with_a_tokenizer_file(tmp_path, no_leaks):
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = pq.read_table(AG_NEWS / "train.parquet").column("text").to_pylist()
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(
        vocab_size=8000, special_tokens=["[UNK]", "[PAD]"]))
    tok_file = tmp_path / "words.json"
    tok.save(str(tok_file))

    out = tmp_path / "ens"
    run_cli("simulate", "--dataset", AG_NEWS, "--num-nodes", "3", "--rounds", "1",
            "--local-epochs", "2", "--lr", "0.05", "--strategy", "ensemble",
            "--tokenizer", tok_file, "--max-tokens", "64", "--output", out)
    meta = json.loads((out / "model.json").read_text())
    assert meta["kind"] == "ensemble" and meta["members"] == 3
    assert meta["input"]["tokenizer"]["kind"] == "file"
    assert meta["input"]["vocab_size"] == tok.get_vocab_size()
    assert meta["model"]["args"]["pad_id"] == tok.token_to_id("[PAD]") == 1
    assert (out / "tokenizer.json").read_text() == tok_file.read_text()
    tok_file.unlink()  # predict needs only the run folder
    (row,) = _predict_texts(out, SPORTS)
    assert row["prediction"] in meta["classes"]
    summary = json.loads((out / "summary.json").read_text())
    ev = json.loads(run_cli("evaluate", out, "--json").stdout)
    assert ev["accuracy"] == pytest.approx(summary["accuracy"], abs=1e-3)
    assert ev["accuracy"] > 0.5


def _tiny_bert_folder(folder):
    """Write a 2-layer BERT (config only) and a WordPiece tokenizer trained on AG News."""
    import pyarrow.parquet as pq
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertConfig, BertTokenizerFast

    corpus = pq.read_table(AG_NEWS / "train.parquet").column("text").to_pylist()
    wordpiece = BertWordPieceTokenizer(lowercase=True)
    wordpiece.train_from_iterator(corpus, vocab_size=3000)
    folder.mkdir()
    wordpiece.save_model(str(folder))  # vocab.txt
    BertTokenizerFast(str(folder / "vocab.txt")).save_pretrained(str(folder))
    BertConfig(vocab_size=3000, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
               intermediate_size=64, max_position_embeddings=64).save_pretrained(str(folder))


def test_a_tiny_transformers_model_on_ag_news(tmp_path, no_leaks):
    import shutil

    bert = tmp_path / "tiny-bert"
    _tiny_bert_folder(bert)
    out = tmp_path / "run"
    run_cli("simulate", "--dataset", AG_NEWS, "--model", f"hf:{bert}", "--tokenizer", bert,
            "--max-tokens", "64", "--num-nodes", "2", "--rounds", "2", "--optimizer", "adam",
            "--lr", "0.001", "--output", out)
    meta = json.loads((out / "model.json").read_text())
    assert meta["model"]["args"]["hf_config"]["model_type"] == "bert"
    assert meta["input"]["tokenizer"]["kind"] == "file" and meta["input"]["pad_id"] == 0
    rounds = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rounds[-1]["train_loss"] < rounds[0]["train_loss"]  # the nodes really trained it
    assert rounds[-1]["accuracy"] > 0.4  # 4 balanced classes: chance is 0.25
    shutil.rmtree(bert)  # the run folder holds the config and the tokenizer
    (row,) = _predict_texts(out, SPORTS)
    assert row["prediction"] in meta["classes"]
