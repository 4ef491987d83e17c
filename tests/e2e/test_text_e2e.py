"""End-to-end text classification: the real CLI on AG News from ../shared/data."""

import csv
import json

import pytest
from helpers.cli import SHARED_DATA, assert_one_error_line, run_cli

pytestmark = pytest.mark.e2e

AG_NEWS = SHARED_DATA / "ag_news"
SPORTS = "The Yankees beat the Red Sox 7-2 as their pitcher threw a shutout in the playoff game"


def _predict_texts(run, *texts):
    proc = run_cli("predict", run, *texts, "--text", "--output", run / "pred.json")
    assert "prediction(s) written" in proc.stdout
    return json.loads((run / "pred.json").read_text())


def test_ag_news_federated_then_predict_a_one_shot_ensemble_and_tracking(tmp_path, no_leaks):
    from fedavg.run.tracking import default_mlflow_uri

    out = tmp_path / "run"
    uri = default_mlflow_uri(tmp_path / "mlruns")
    run_cli("simulate", "--dataset", AG_NEWS, "--num-nodes", "3", "--rounds", "2",
            "--local-epochs", "2", "--save-node-models", "--output", out,
            "--tensorboard", tmp_path / "tb", "--mlflow-uri", uri)
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

    # the nodes' text models merged once into an output ensemble, saved and reloaded
    ens = tmp_path / "ensemble"
    run_cli("merge", out / "nodes", "--strategy", "ensemble", "--output", ens,
            "--dataset", AG_NEWS)
    ens_meta = json.loads((ens / "model.json").read_text())
    assert ens_meta["kind"] == "ensemble" and ens_meta["members"] == 3
    assert ens_meta["input"] == meta["input"]
    (row,) = _predict_texts(ens, SPORTS)
    assert row["prediction"] in meta["classes"]
    ev = json.loads(run_cli("evaluate", ens, "--json").stdout)
    assert ev["accuracy"] == pytest.approx(
        json.loads((ens / "summary.json").read_text())["accuracy"], abs=1e-3)
    assert ev["accuracy"] > 0.6

    # the same run, tracked: TensorBoard scalars and an MLflow run, read back
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rounds = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(tmp_path / "tb" / "run"))
    events.Reload()
    assert [(e.step, pytest.approx(e.value)) for e in events.Scalars("fedavg/accuracy")] == \
        [(r["round"], r["accuracy"]) for r in rounds]
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    (tracked,) = client.search_runs([client.get_experiment_by_name("fedavg").experiment_id])
    assert tracked.info.status == "FINISHED" and tracked.data.params["num-nodes"] == "3"
    assert tracked.data.metrics["accuracy"] == pytest.approx(rounds[-1]["accuracy"])
    files = {a.path for a in client.list_artifacts(tracked.info.run_id, "model")}
    assert {"model/model.safetensors", "model/model.json", "model/summary.json"} <= files


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
    assert meta["input"]["vocab_size"] == 3000
    assert json.loads((out / "tokenizer.json").read_text())["model"]["type"] == "WordPiece"
    rounds = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rounds[-1]["train_loss"] < rounds[0]["train_loss"]  # the nodes really trained it
    assert rounds[-1]["accuracy"] > 0.4  # 4 balanced classes: chance is 0.25
    shutil.rmtree(bert)  # the run folder holds the config and the tokenizer
    (row,) = _predict_texts(out, SPORTS)
    assert row["prediction"] in meta["classes"]
