"""Every user mistake answers in one line, loses nothing and exits non-zero.

Mistakes on the command line (one ``error:`` line on stderr, exit code 2), bad files and
inputs as a new user meets them, and bad input found by trying to break the tool (a one-line
UserError, nothing already computed lost).
"""

import json
import logging
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from helpers.cli import assert_one_error_line, run_cli
from PIL import Image
from typer.testing import CliRunner

from fedavg.cli.app import app
from fedavg.config.settings import RunConfig
from fedavg.data.load import decode_images, load
from fedavg.data.partition import group_values, partition, values_per_node
from fedavg.models.evaluation import evaluation_device, resolve_device
from fedavg.models.registry import build_model
from fedavg.run import checkpoint
from fedavg.run.display import natural_note, partition_table
from fedavg.run.lifecycle import check_output, default_output, prepare
from fedavg.util.errors import UserError

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 120

MODEL_META = {
    "model": {"name": "mlp", "input_shape": [1, 8, 8], "num_classes": 10, "args": {}},
    "classes": [str(i) for i in range(10)],
    "input": {"shape": [1, 8, 8], "dtype": "uint8", "scale": 1 / 255,
              "mean": [0.3], "std": [0.4]},
}


# --- helpers ------------------------------------------------------------------------------------


def ray_processes_of(pids: set[int]) -> list[str]:
    """Command lines of raylet/gcs_server processes whose Ray session belongs to ``pids``.

    Ray names its session folder ``session_<date>_<time>_<usec>_<driver pid>``; other
    processes on this machine (e.g. someone else's training run) may have their own.
    """
    found = []
    me = os.getpid()
    mine = {c.pid for c in psutil.Process(me).children(recursive=True)}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "raylet" not in cmd and "gcs_server" not in cmd:
            continue
        owners = {int(m) for m in re.findall(r"session_[\d_-]+?_(\d+)(?:/|\s|$)", cmd)}
        if owners & (pids | {me}) or proc.info["pid"] in mine:
            found.append(cmd[:200])
    return found


def run_in(args, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``python -m fedavg.cli ARGS`` offline; check Ray never started for it."""
    ray_tmp = cwd / "ray-tmp"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "RAY_TMPDIR": str(ray_tmp), "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "fedavg.cli", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"fedavg {' '.join(args)} did not return within {TIMEOUT} s")
    assert not ray_tmp.exists(), "Ray was started"
    assert ray_processes_of({proc.pid}) == []
    assert not (cwd / "runs").exists(), "a run folder was created"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(autouse=True)
def keep_signal_handlers():
    """``fedavg simulate`` installs SIGINT/SIGTERM handlers; do not leave them in pytest."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


@pytest.fixture
def invoke(tmp_path, monkeypatch):
    """Run the typer app in-process from ``tmp_path``; return (exit code, stderr)."""
    monkeypatch.chdir(tmp_path)
    # simulate() sets a few environment defaults and Flower's log level; undo that after
    env = dict(os.environ)
    flwr_level = logging.getLogger("flwr").level
    runner = CliRunner()

    def _invoke(*args):
        result = runner.invoke(app, [str(a) for a in args])
        assert result.exception is None or isinstance(result.exception, SystemExit), (
            repr(result.exception))
        assert not (tmp_path / "runs").exists(), "a run folder was created"
        return result.exit_code, result.stderr

    yield _invoke
    os.environ.clear()
    os.environ.update(env)
    logging.getLogger("flwr").setLevel(flwr_level)
    ray = sys.modules.get("ray")
    assert ray is None or not ray.is_initialized(), "Ray was started in-process"
    assert ray_processes_of(set()) == []


@pytest.fixture
def model_dir(tmp_path):
    """Return a valid saved model (an MLP for 8x8 digits)."""
    return checkpoint.save(tmp_path / "model", build_model("mlp", (1, 8, 8), 10).state_dict(),
                           MODEL_META)


@pytest.fixture
def csv_dataset(tmp_path):
    path = tmp_path / "tiny.csv"
    rows = ["a,b,label"] + [f"{i},{2 * i},{'xy'[i % 2]}" for i in range(10)]
    path.write_text("\n".join(rows) + "\n")
    return path


# --- subprocess cases ---------------------------------------------------------------------------

SUBPROCESS_CASES = {
    "unknown-dataset": (["simulate", "--dataset", "no-such-dataset-xyz"],
                        "unknown dataset 'no-such-dataset-xyz'"),
    "missing-dir": (["simulate", "--dataset", "./missing-dir"],
                    "no such file or folder: ./missing-dir"),
    "too-many-nodes": (["simulate", "--num-nodes", "5000"], "--num-nodes <="),
    "unknown-model": (["simulate", "--model", "nope"], "unknown model 'nope'"),
}


@pytest.mark.parametrize("case", [
    "unknown-dataset",
    "missing-dir",
    "too-many-nodes",
    "unknown-model",  # checked after loading and partitioning: no progress bars on stderr
])
def test_subprocess_errors(tmp_path, case):
    args, expected = SUBPROCESS_CASES[case]
    res = run_in(args, tmp_path)
    assert res.returncode == 2, res.stderr
    line = assert_one_error_line(res.stderr)
    assert expected in line


@pytest.mark.parametrize("args, expected", [
    (["simulate", "--strategy", "fedavgm", "--server-lr", "abc"],
     "invalid value for '--server-lr': 'abc' is not a valid float"),
    (["simulate", "--mu"], "option '--mu' requires an argument"),
    (["simulate", "--no-such-option", "1"], "no such option"),
])
def test_subprocess_usage_mistakes_are_one_line(tmp_path, args, expected):
    res = run_in(args, tmp_path)
    assert res.returncode == 2, res.stderr
    line = assert_one_error_line(res.stderr)
    assert expected in line and "fedavg simulate --help" in line


def test_subprocess_corrupt_model(tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"\x00\x01garbage" * 20)
    (folder / "model.json").write_text(json.dumps({"format": "fedavg-model/1", **MODEL_META}))
    res = run_in(["evaluate", str(folder), "--dataset", "digits"], tmp_path)
    assert res.returncode == 2
    line = assert_one_error_line(res.stderr)
    assert "model.safetensors" in line and "damaged" in line


def test_subprocess_missing_image_in_subfolder(tmp_path, model_dir):
    res = run_in(["predict", str(model_dir), "pics/missing.png"], tmp_path)
    assert res.returncode == 2
    line = assert_one_error_line(res.stderr)
    assert "no such file or folder: pics/missing.png" in line


@pytest.mark.parametrize("args", [["predict", "{model}", "digits"],  # CSV, print()
                                  ["predict", "{model}", "digits", "--output", "p.csv"],
                                  ["evaluate", "{model}", "--dataset", "digits", "--json"],
                                  ["evaluate", "{model}", "--dataset", "digits"],  # rich
                                  ["strategies"]])
def test_subprocess_output_into_a_closed_pipe_is_quiet(tmp_path, model_dir, args):
    """``fedavg ... | head -1``: the reader leaves early; no traceback, exit code 0.

    Buffered output, as in a user's shell: with ``PYTHONUNBUFFERED`` set, ``print`` wrote at
    once and hid a closed pipe met only by the interpreter's last flush (exit code 120).
    """
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_DATASETS_OFFLINE": "1"}
    env.pop("PYTHONUNBUFFERED", None)
    args = [a.format(model=model_dir) for a in args]
    proc = subprocess.Popen([sys.executable, "-m", "fedavg.cli", *args], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the first prediction is written: every write fails
    try:
        err = proc.stderr.read().decode()
        code = proc.wait(timeout=TIMEOUT)
    finally:
        proc.kill()
    assert code == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception" not in err
    if "--output" in args:  # the file is whole, whatever became of the console line
        assert len((tmp_path / "p.csv").read_text().splitlines()) == 1 + 1797  # all of digits


def test_ctrl_c_while_the_interpreter_shuts_down_after_a_command_is_no_traceback(tmp_path):
    """A Ctrl-C just after a command (`fedavg evaluate`) printed its result is no traceback.

    It raised inside torch's exit hook: 'Exception ignored in atexit callback ...
    Traceback ... KeyboardInterrupt'.
    """
    script = tmp_path / "late_ctrl_c.py"
    script.write_text(
        "import atexit, os, signal, time\n"
        "import typer\n"
        "from fedavg.cli.support import run_app\n"
        "def late():  # an exit hook that takes a while, as torch's do\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(2)\n"
        "atexit.register(late)\n"
        "app = typer.Typer()\n"
        "@app.command()\n"
        "def done():\n"
        "    print('result')\n"
        "run_app(app)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert proc.stdout == "result\n"
    assert proc.returncode == -signal.SIGINT, proc.stderr  # ended by the Ctrl-C, at once
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr


# --- in-process cases ---------------------------------------------------------------------------


@pytest.mark.parametrize("args,expected", [
    (["--alpha", "0", "--partitioner", "dirichlet"], "--alpha must be > 0"),
    (["--alpha", "-1"], "--alpha must be > 0 (got -1.0)"),
    (["--fraction", "0"], "--fraction must be in (0, 1]"),
    (["--fraction", "1.5"], "--fraction must be in (0, 1]"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--num-nodes", "0"], "--num-nodes must be >= 1"),
    (["--strategy", "nope"], "unknown strategy 'nope'"),
    (["--partitioner", "shards"], "unknown partitioner 'shards'"),
    (["--partitioner", "natural"], "--partition-by"),
    (["--lr", "0"], "--lr must be > 0"),
    (["--momentum", "1"], "--momentum must be in [0, 1)"),
    (["--device", "quantum"], "unknown device 'quantum'"),
    (["--seed", "99999999999999999999999"], "--seed must be >= 0 and < 2147483648"),
    (["--strategy", ""], "setting 'strategy' needs a value"),
    (["--model", " "], "setting 'model' needs a value"),
    (["--strategy", "fedavgm", "--server-lr", "inf"], "--server-lr must be a finite number"),
    (["--strategy", "fedprox", "--mu", "nan"], "--mu must be a finite number"),
    (["--weight-decay", "nan"], "--weight-decay must be >= 0 and finite"),
    (["--lr", "inf"], "--lr must be > 0 and finite"),
    (["--alpha", "inf", "--partitioner", "dirichlet"], "--alpha must be finite"),
    (["--strategy", "distill", "--rounds", "1", "--distill-lr", "0"], "--distill-lr must be > 0"),
    (["--gpus-per-node", "-1"], "--gpus-per-node must be >= 0"),
])
def test_simulate_bad_options(invoke, args, expected):
    code, stderr = invoke("simulate", *args)
    assert code == 2
    assert expected in assert_one_error_line(stderr)


def test_simulate_missing_path(invoke):
    code, stderr = invoke("simulate", "--dataset", "./missing-dir")
    assert code == 2
    assert "no such file or folder: ./missing-dir" in assert_one_error_line(stderr)


@pytest.mark.parametrize("flag", ["--label-column", "--image-column"])
def test_simulate_missing_column(invoke, csv_dataset, flag):
    code, stderr = invoke("simulate", "--dataset", csv_dataset, flag, "nope")
    assert code == 2
    line = assert_one_error_line(stderr)
    assert "'nope'" in line and flag in line and "a, b, label" in line


def test_simulate_no_label_column(invoke, tmp_path):
    path = tmp_path / "nolabel.csv"
    path.write_text("a,b\n1,2\n3,4\n")
    code, stderr = invoke("simulate", "--dataset", path)
    assert code == 2
    assert "no label column" in assert_one_error_line(stderr)


def test_evaluate_missing_folder(invoke):
    code, stderr = invoke("evaluate", "no-such-run")
    assert code == 2
    assert "no such model folder: no-such-run" in assert_one_error_line(stderr)


def test_a_model_file_given_for_its_folder_says_to_pass_the_folder(invoke, model_dir):
    for args in (("evaluate", model_dir / "model.json"), ("merge", model_dir / "model.json",
                                                          model_dir, "--output", "m")):
        code, stderr = invoke(*args)
        assert code == 2
        assert f"{model_dir / 'model.json'} is a file, not a model folder: pass its folder" \
            in assert_one_error_line(stderr)


def test_a_tabular_model_given_text_is_told_to_take_a_table(tmp_path):
    from fedavg.use.inference import predict

    meta = {**MODEL_META, "model": {**MODEL_META["model"], "input_shape": [3]},
            "input": {"kind": "tabular", "shape": [3], "dtype": "float32", "scale": 1.0,
                      "mean": [0.0] * 3, "std": [1.0] * 3}}
    net = build_model("mlp", (3,), 10)
    model = checkpoint.save(tmp_path / "t", net.state_dict(), meta)
    with pytest.raises(UserError, match="takes tabular inputs, not text: pass a dataset "
                                        r"\(a table\)$"):
        predict(model, ["1,2,3"], text=True)


def test_evaluate_folder_without_artifacts(invoke, tmp_path):
    (tmp_path / "empty").mkdir()
    code, stderr = invoke("evaluate", tmp_path / "empty")
    assert code == 2
    assert "has no model.safetensors" in assert_one_error_line(stderr)


def test_evaluate_corrupt_weights(invoke, model_dir):
    (model_dir / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    code, stderr = invoke("evaluate", model_dir, "--dataset", "digits")
    assert code == 2
    assert "damaged" in assert_one_error_line(stderr)


def test_evaluate_bad_json(invoke, model_dir):
    (model_dir / "model.json").write_text("{not json")
    code, stderr = invoke("evaluate", model_dir)
    assert code == 2
    assert "not valid JSON" in assert_one_error_line(stderr)


def test_evaluate_unknown_split(invoke, model_dir):
    code, stderr = invoke("evaluate", model_dir, "--dataset", "digits", "--split", "dev")
    assert code == 2
    assert "has no split 'dev'" in assert_one_error_line(stderr)


def test_predict_missing_input(invoke, model_dir):
    code, stderr = invoke("predict", model_dir, "missing.png")
    assert code == 2
    assert "no such file or folder: missing.png" in assert_one_error_line(stderr)


def test_predict_bad_output_suffix(invoke, model_dir, tmp_path):
    image = tmp_path / "one.png"
    from PIL import Image

    Image.fromarray(np.zeros((8, 8), np.uint8)).save(image)
    code, stderr = invoke("predict", model_dir, image, "--output", "x.txt")
    assert code == 2
    line = assert_one_error_line(stderr)
    assert "--output must end in .csv or .json" in line and "x.txt" in line
    assert not (tmp_path / "x.txt").exists()
    # the same call with a .csv output works, so only the suffix was wrong
    code, _ = invoke("predict", model_dir, image, "--output", "x.csv")
    assert code == 0 and (tmp_path / "x.csv").read_text().startswith("input,prediction")


@pytest.mark.parametrize("target", ["model.json", "tokenizer.json", "summary.json",
                                    "input"])
def test_predict_never_writes_over_the_model_folder_or_an_input(invoke, model_dir, tmp_path,
                                                                target):
    from PIL import Image

    (tmp_path / "input.json").write_text("[]")  # an input named like a predictions file
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(tmp_path / "one.png")
    out = tmp_path / "input.json" if target == "input" else model_dir / target
    out.touch()
    before = {p: p.read_bytes() for p in (*model_dir.iterdir(), tmp_path / "input.json")}
    inputs = ["one.png", "input.json"] if target == "input" else ["one.png"]
    code, stderr = invoke("predict", model_dir, *inputs, "--output", out)
    assert code == 2
    line = assert_one_error_line(stderr)
    assert ("is one of the inputs" if target == "input" else
            f"would replace a run's or model's own {target}") in line
    assert {p: p.read_bytes() for p in before} == before
    if target == "model.json":  # another run's, not the model predicting
        other = tmp_path / "other"
        other.mkdir()
        (other / "model.json").write_text("{}")
        code, stderr = invoke("predict", model_dir, "one.png", "--output", other / "model.json")
        assert code == 2 and "would replace a run's or model's own model.json" in stderr
        assert (other / "model.json").read_text() == "{}"
    # the same call with another output file works
    code, _ = invoke("predict", model_dir, "one.png", "--output", tmp_path / "p.json")
    assert code == 0 and json.loads((tmp_path / "p.json").read_text())[0]["input"]


def test_predict_on_a_dataset_without_labels_says_how_to_give_unlabelled_inputs(invoke,
                                                                                 model_dir,
                                                                                 tmp_path):
    (tmp_path / "notes.csv").write_text("text\nhello\nworld\n")
    code, stderr = invoke("predict", model_dir, "notes.csv")
    assert code == 2
    line = assert_one_error_line(stderr)
    assert line.startswith("error: notes.csv: a dataset input needs a label column")
    assert ".txt file of texts" in line and "--label-column" not in line


def test_predict_unsupported_input(invoke, model_dir, tmp_path):
    (tmp_path / "notes.docx").write_bytes(b"PK")
    code, stderr = invoke("predict", model_dir, "notes.docx")
    assert code == 2
    assert "neither an image" in assert_one_error_line(stderr)


def test_an_error_line_keeps_square_brackets(invoke):
    code, err = invoke("simulate", "--dataset", "runs/x[old]/data.csv")
    assert code == 2
    assert assert_one_error_line(err) == "error: no such file or folder: runs/x[old]/data.csv"
    code, err = invoke("evaluate", "no[such]model")
    assert code == 2 and "no[such]model" in assert_one_error_line(err)


def test_line_breaks_in_a_user_value_stay_on_the_one_error_line():
    from fedavg.cli.support import one_line

    text = one_line("--resume a\nb\x85c\u2028d\re: no such folder")
    assert len(text.splitlines()) == 1
    assert text == "--resume a\\nb\\x85c\\u2028d\\re: no such folder"


@pytest.mark.parametrize("target, args, message", [
    ("fedavg.use.inference.evaluate_model", ["evaluate", "{model}"], "interrupted"),
    ("fedavg.use.inference.predict", ["predict", "{model}", "x.png", "--output", "p.csv"],
     "interrupted: no predictions were written"),
    ("fedavg.use.merge.merge_models", ["merge", "{model}", "{model}"],
     "interrupted: no merged model was written"),
    ("fedavg.sweeps.report.write_report", ["report", "{model}"],
     "interrupted: run `fedavg report` again for a whole report"),
])
def test_ctrl_c_in_a_command_says_so_and_exits_130(invoke, monkeypatch, model_dir, target,
                                                   args, message):
    module, name = target.rsplit(".", 1)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(sys.modules[module] if module in sys.modules
                        else __import__(module, fromlist=[name]), name, interrupted)
    code, err = invoke(*[a.format(model=model_dir) for a in args])
    assert code == 130
    assert err.strip() == message


def test_an_output_name_too_long_for_the_file_system_is_one_line(invoke):
    code, stderr = invoke("simulate", "--rounds", "1", "--output", "e" * 300)
    assert code == 2
    assert "File name too long; give another folder" in assert_one_error_line(stderr)


def test_an_output_link_to_nowhere_says_so(invoke, tmp_path):
    """It said 'File exists' about a folder that does not exist."""
    (tmp_path / "out").symlink_to(tmp_path / "gone" / "run")
    code, stderr = invoke("simulate", "--rounds", "1", "--output", tmp_path / "out")
    assert code == 2
    assert assert_one_error_line(stderr).endswith(
        f"out: it links to {tmp_path / 'gone' / 'run'}, which does not exist; create that or "
        "pass another --output")


def test_a_dataset_or_input_name_too_long_for_the_file_system_is_one_line(invoke, model_dir):
    for args in (("simulate", "--rounds", "1", "--dataset", "d" * 300),
                 ("evaluate", model_dir, "--dataset", "d" * 300),
                 ("predict", model_dir, "d" * 300)):
        code, stderr = invoke(*args)  # was OSError's traceback
        assert code == 2 and "File name too long" in assert_one_error_line(stderr), stderr


@pytest.mark.parametrize("args", [
    ("simulate", "--rounds", "1", "--output", ""), ("simulate", "--resume", ""),
    ("coordinator", "--output", ""), ("merge", "a", "b", "--output", ""), ("certs", ""),
    ("evaluate", ""), ("predict", "", "digits"), ("sweep", ""), ("report", " "),
])
def test_an_empty_path_is_refused_not_read_as_the_current_folder(invoke, tmp_path, args):
    code, stderr = invoke(*args)  # e.g. --output "$OUT" with OUT unset
    assert code == 2 and "needs a path, not an empty string" in stderr, stderr
    assert list(tmp_path.iterdir()) == []  # no run, merge or certificate in the current folder


def test_the_python_api_refuses_an_empty_output(tmp_path, monkeypatch):
    import fedavg
    from fedavg.util.errors import UserError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="output needs a path, not an empty string"):
        fedavg.simulate(num_nodes=2, rounds=1, output="")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("given, message", [
    ({"overwrite": "no"}, "overwrite must be bool, got 'no'"),  # "no" would read as yes
    ({"cpus_per_node": "x"}, "cpus_per_node must be int or float, got 'x'"),
    ({"tracking": "tb"}, "tracking must be TrackingOptions or None, got 'tb'"),
    ({"ray_address": 123}, "ray_address must be str or None, got 123"),
    ({"resume": True}, "resume must be str or PathLike or None, got True"),
    ({"console": "yes"}, "console must be a rich.console.Console or None, got 'yes'"),
])
def test_the_python_api_names_an_argument_of_a_wrong_type(tmp_path, given, message):
    import fedavg

    run = tmp_path / "run"
    run.mkdir()
    (run / "model.json").write_text("{}")  # a run someone made
    with pytest.raises(TypeError, match=re.escape(message)):
        fedavg.simulate(num_nodes=2, rounds=1, output=run, **given)
    assert (run / "model.json").read_text() == "{}" and len(list(run.iterdir())) == 1


def test_merge_models_refuses_an_overwrite_that_is_no_bool(tmp_path, model_dir):
    from fedavg.use.merge import merge_models

    out = tmp_path / "out"
    out.mkdir()
    (out / "model.json").write_text("{}")  # a merge someone made
    other = tmp_path / "other"
    shutil.copytree(model_dir, other)
    from safetensors.torch import load_file, save_file

    weights = other / "model.safetensors"  # another model (a copy would be refused as one)
    save_file({k: v + 1 for k, v in load_file(weights).items()}, weights)
    with pytest.raises(TypeError, match="overwrite must be bool, got 'no'"):
        merge_models([model_dir, other], out, overwrite="no")
    assert (out / "model.json").read_text() == "{}"


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-1"])
def test_cpus_per_node_out_of_range_is_one_line(invoke, value):
    code, stderr = invoke("simulate", "--num-nodes", "2", "--rounds", "1", "--cpus-per-node",
                          value)
    assert code == 2  # nan slipped past the check and failed in Ray's set-up (exit 1)
    assert "--cpus-per-node must be in (0, " in assert_one_error_line(stderr)


@pytest.mark.parametrize("args, expected", [
    (["--dp-noise", "1"], "--dp-noise needs --dp-clip C"),
    (["--dp-noise", "1", "--dp-clip", "0"], "--dp-clip must be > 0 and finite"),
    (["--dp-noise", "nan", "--dp-clip", "1"], "--dp-noise must be >= 0 and finite"),
    (["--dp-noise", "1e300", "--dp-clip", "1"], "--dp-noise must be at most 1000"),
    (["--dp-noise", "1", "--dp-clip", "1e300"], "--dp-clip must be at most 1e6"),
    (["--dp-noise", "1", "--dp-clip", "1", "--dp-delta", "1"], "--dp-delta must be in (0, 1)"),
    (["--dp-epsilon", "3"], "--dp-epsilon needs DP: give --dp-noise"),
    (["--dp-noise", "1", "--dp-clip", "1", "--dp-epsilon", "-2"], "--dp-epsilon must be > 0"),
    (["--dp-noise", "1", "--dp-clip", "1", "--strategy", "fedmedian"],
     "fedmedian's merge is not a mean of the node updates"),
    (["--dp-noise", "0.5", "--dp-clip", "1", "--dp-epsilon", "1"],
     "--dp-epsilon 1 allows no more round"),
    (["--compress-down", "topk"], "--compress-down must be one of none, int8"),
    (["--dp-sgd"], "--dp-sgd needs --dp-noise z"),
    (["--dp-sgd", "--dp-noise", "1", "--dp-clip", "1"], "--dp-clip is node-level DP's"),
    (["--dp-sgd", "--dp-noise", "1", "--dp-max-grad-norm", "0"],
     "--dp-max-grad-norm must be > 0"),
    (["--dp-sgd", "--dp-noise", "1", "--strategy", "fedprox"],
     "--dp-sgd: fedprox changes how nodes train"),
    (["--dp-sgd", "--dp-noise", "1", "--sam-rho", "0.05"], "--dp-sgd: --sam-rho takes a"),
    (["--dp-sgd", "--dp-noise", "1", "--model", "resnet18"],
     "--dp-sgd: layer 'bn1' (BatchNorm2d) has no per-sample gradient"),
    (["--dp-sgd", "--dp-noise", "0.3", "--dp-epsilon", "1"], "--dp-epsilon 1 allows no more"),
    (["--secure-aggregation", "--secagg-max-weight", "100"],
     "--secagg-max-weight 100 is below the largest partition (719 samples)"),
    (["--secure-aggregation", "--dp-noise", "1", "--dp-clip", "1"],
     "--dp-noise with --secure-aggregation: node-level DP clipped on the coordinator needs "
     "each node's update, which --secure-aggregation hides: give --dp-clip-on node"),
    (["--dp-clip-on", "node"], "--dp-clip-on node has the nodes clip node-level DP's updates"),
    (["--secure-aggregation", "--secagg-num-shares", "1e300"],
     "--secagg-num-shares 1e+300 is above --secagg-modulus-range / "
     "--secagg-quantization-range (1024)"),
    (["--secure-aggregation", "--secagg-num-shares", "nan"],
     "--secagg-num-shares must be > 0 and finite"),
    (["--dp-clip-on", "edge"], "--dp-clip-on must be one of coordinator, node"),
])
def test_privacy_and_downlink_settings_are_checked_in_one_line(invoke, args, expected):
    code, stderr = invoke("simulate", "--num-nodes", "2", "--rounds", "2", *args)
    assert code == 2
    assert expected in assert_one_error_line(stderr)


def test_the_python_api_names_inputs_of_the_wrong_kind(model_dir):
    import numpy as np

    import fedavg
    from fedavg.util.errors import UserError

    for kwargs, words in (({"dataset": np.zeros((10, 8, 8))},
                           "setting 'dataset' expects a str (a name or path), got ndarray"),
                          ({"model": lambda shape, k: None},
                           "got function (your own builder goes by name, 'file.py:function'")):
        with pytest.raises(UserError, match=re.escape(words)):  # was "File name too long"
            fedavg.simulate(num_nodes=2, rounds=1, **kwargs)
    for inputs, words in ((np.zeros((2, 8, 8)), "got ndarray"), (None, "got NoneType"),
                          ([np.zeros((8, 8))], "got list holding ndarray")):
        with pytest.raises(TypeError, match=re.escape(words)):
            fedavg.predict(model_dir, inputs)
    with pytest.raises(TypeError, match=re.escape("got the single 'runs/x/nodes': pass")):
        fedavg.merge_models("runs/x/nodes", "merged")  # it took each character as a folder
    with pytest.raises(TypeError, match="config must be a RunConfig, got dict"):
        fedavg.merge_models(["a", "b"], "merged", {"strategy": "average"})


def test_the_python_api_predict_and_evaluate_name_a_wrong_argument(model_dir):
    from fedavg.use import inference

    with pytest.raises(TypeError, match=r"inputs must be a list of inputs, got the single "
                                        r"'digits': pass \['digits'\]"):
        inference.predict(model_dir, "digits")
    for call in (lambda: inference.predict(model_dir, ["digits"], batch_size=-1),
                 lambda: inference.evaluate_model(model_dir, "digits", batch_size=0)):
        with pytest.raises(TypeError, match="batch_size must be a whole number >= 1"):
            call()


def test_the_library_logs_nothing_unless_the_program_sets_up_logging():
    """``simulate(console=None)`` prints nothing: no warning of fedavg's reaches stderr."""
    code = ("import logging, fedavg; logging.getLogger('fedavg.run.flower_adapter').warning("
            "'round 1: node 0 left out'); print('done')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=TIMEOUT)
    assert proc.returncode == 0 and proc.stdout == "done\n"
    assert proc.stderr == ""


def test_the_python_api_names_python_arguments_not_cli_flags(tmp_path, monkeypatch):
    """`fedavg.simulate(mu=0.1)` said "does not take --mu"; the CLI keeps its flags."""
    import fedavg
    from fedavg.util.errors import UserError, python_names

    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as caught:
        fedavg.simulate(strategy="fedavg", mu=0.1)
    assert str(caught.value) == "strategy fedavg does not take mu (it takes no options)"
    with pytest.raises(UserError, match=r"^alpha must be > 0 \(got -1.0\)"):
        fedavg.simulate(partitioner="dirichlet", alpha=-1)
    assert python_names("pass --label-column or --text-column, not -x or a--b") == \
        "pass label_column or text_column, not -x or a--b"
    for cli, python in (  # values as Python takes them; paths and shell commands untouched
            ("--odd/run already holds a run; choose another --output or pass --overwrite",
             "--odd/run already holds a run; choose another output or pass overwrite"),
            ("no such file or folder: ./--odd/x.png", "no such file or folder: ./--odd/x.png"),
            ("pass --rounds N with N > 1", "pass rounds=N with N > 1"),
            ("--resume r: --lr 0.5 differs", "resume=r: lr=0.5 differs"),
            ("(--model-arg nope=...); choose smaller --model-arg values",
             "(model_args nope=...); choose smaller model_args values"),
            ("resume with: fedavg simulate --resume runs/demo",
             "resume with: fedavg simulate --resume runs/demo"),
            ("pass --model /x/y.py:build to run it", "pass model=/x/y.py:build to run it"),
            ("see `fedavg strategies --help`; pass --mu.", "see `fedavg strategies --help`; "
                                                           "pass mu."),
            ("strategy fedavg does not take --mu", "strategy fedavg does not take mu")):
        assert python_names(cli) == python, cli
    with pytest.raises(UserError, match=r"^setting 'num_nodes' expects int, got 3.5"):
        fedavg.simulate(num_nodes=3.5)
    assert list(tmp_path.iterdir()) == []


def test_the_cli_names_its_flags(invoke):
    code, stderr = invoke("simulate", "--strategy", "fedavg", "--mu", "0.1")
    assert code == 2 and "does not take --mu" in assert_one_error_line(stderr)


def test_a_model_too_big_for_memory_says_so(invoke):
    """It said the model 'cannot take inputs of shape (1, 8, 8)', quoting torch's allocator."""
    code, stderr = invoke("simulate", "--model", "mlp", "--model-arg", "hidden=10000000",
                          "--rounds", "1")
    line = assert_one_error_line(stderr)
    assert code == 2 and "model 'mlp' with {'hidden': 10000000} is too big to build: one of " \
        "its tensors needs" in line and "choose smaller --model-arg values" in line, line
    assert "shape" not in line and "alloc_cpu" not in line
    from fedavg.models.registry import _allocation_failed

    assert _allocation_failed(RuntimeError(  # 100 MiB: 0.1 GiB, not "0 GiB"
        "DefaultCPUAllocator: can't allocate memory: you tried to allocate 104857600 bytes"
    )) == "one of its tensors needs 0.1 GiB"
    assert _allocation_failed(MemoryError()) == "not enough memory for its weights"
    assert _allocation_failed(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None


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


# --- found by tests/cli/test_properties.py ------------------------------------------------------


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


@pytest.mark.parametrize("args", [["--cpus-per-node", "1e-9"],
                                  ["--gpus-per-node", "0.00005", "--device", "cpu"]])
def test_a_resource_share_below_rays_unit_is_refused_before_anything_starts(args):
    proc = run_cli("simulate", *args, "--rounds", "1", check=False, timeout=120)
    assert proc.returncode == 2
    line = assert_one_error_line(proc.stderr)
    assert f"{args[0]} must be at least 0.0001" in line and "units of 0.0001" in line



LONG = "x" * 300  # one name longer than the 255 bytes a file system allows


@pytest.mark.parametrize("args", [
    ["evaluate", LONG], ["evaluate", "{model}", "--dataset", LONG], ["predict", LONG, "."],
    ["report", LONG], ["report", ".", "--published", LONG], ["merge", LONG, LONG, "--output", "m"],
    ["simulate", "--resume", LONG], ["simulate", "--dataset", "{ag_news}", "--tokenizer", LONG],
    ["simulate", "--strategy", "greedy-soup", "--rounds", "1", "--validation", LONG],
], ids=lambda a: " ".join(a[:2] if a[1] != "{model}" else a[::2]))
def test_a_name_too_long_is_one_line_wherever_a_path_is_given(invoke, model_dir, args):
    from helpers.cli import SHARED_DATA

    filled = [a.format(model=model_dir, ag_news=SHARED_DATA / "ag_news") for a in args]
    code, err = invoke(*filled)
    line = assert_one_error_line(err)
    assert code == 2 and "too long" in line.lower() and len(line) < 300, line


def test_an_empty_predict_input_is_refused_not_read_as_the_current_folder(model_dir, tmp_path):
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(tmp_path / "digit.png")  # in the cwd
    res = run_in(["predict", str(model_dir), ""], tmp_path)
    assert res.returncode == 2 and "not an empty string" in assert_one_error_line(res.stderr)


@pytest.mark.parametrize("args, words", [
    (["simulate", "--dataset", "{ag_news}", "--tokenizer", "/dev/null"],
     "--tokenizer /dev/null: not a file or folder"),
    (["simulate", "--model", "torchvision:mobilenet_v2", "--model-arg", "dropout=abc"],
     "--model-arg dropout='abc' must be a number (torchvision:mobilenet_v2's default is 0.2)"),
    (["simulate", "--model", "mlp", "--model-arg", "hidden=abc"],
     "--model-arg hidden='abc' must be a whole number"),
    (["predict", "{model}", "/dev/null"], "/dev/null is not a file or folder"),
], ids=["tokenizer-device", "torchvision-arg-type", "builtin-arg-type", "predict-device"])
def test_odd_values_are_said_in_the_products_words(invoke, model_dir, args, words):
    from helpers.cli import SHARED_DATA

    filled = [a.format(model=model_dir, ag_news=SHARED_DATA / "ag_news") for a in args]
    code, err = invoke(*filled)
    line = assert_one_error_line(err)
    assert code == 2 and words in line and "not supported between" not in line, line


@pytest.mark.parametrize("args", [["merge", "~nobody-here/x"], ["export", "~nobody-here/x",
                                                                 "--output", "out"],
                                  ["merge", "a\x00b"]], ids=["merge-user", "export-user", "nul"])
def test_an_unknown_users_home_or_a_nul_in_a_path_is_one_line(invoke, args):
    code, err = invoke(*args)
    line = assert_one_error_line(err)
    assert code == 2 and ("~NAME" in line or "NUL" in line or "no such" in line), line
