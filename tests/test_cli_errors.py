"""Every user mistake on the command line: one ``error:`` line on stderr, exit code 2.

All of these fail before any training starts, so none of them may start Ray. A few run as
real subprocesses (``python -m fedavg.cli.app``); the rest go through typer's ``CliRunner``.
"""

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
from conftest import assert_one_error_line
from typer.testing import CliRunner

from fedavg.cli.app import app
from fedavg.models.registry import build_model
from fedavg.run import checkpoint
from fedavg.util.errors import UserError

REPO = Path(__file__).resolve().parents[1]
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


def run_cli(args, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``python -m fedavg.cli.app ARGS`` offline; check Ray never started for it."""
    ray_tmp = cwd / "ray-tmp"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "RAY_TMPDIR": str(ray_tmp), "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "fedavg.cli.app", *args], cwd=cwd, env=env,
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
    res = run_cli(args, tmp_path)
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
    res = run_cli(args, tmp_path)
    assert res.returncode == 2, res.stderr
    line = assert_one_error_line(res.stderr)
    assert expected in line and "fedavg simulate --help" in line


def test_subprocess_corrupt_model(tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"\x00\x01garbage" * 20)
    (folder / "model.json").write_text(json.dumps({"format": "fedavg-model/1", **MODEL_META}))
    res = run_cli(["evaluate", str(folder), "--dataset", "digits"], tmp_path)
    assert res.returncode == 2
    line = assert_one_error_line(res.stderr)
    assert "model.safetensors" in line and "damaged" in line


def test_subprocess_missing_image_in_subfolder(tmp_path, model_dir):
    res = run_cli(["predict", str(model_dir), "pics/missing.png"], tmp_path)
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
    proc = subprocess.Popen([sys.executable, "-m", "fedavg.cli.app", *args], cwd=tmp_path,
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
