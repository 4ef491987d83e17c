"""What a new user reads: the version, help texts, tables at any width, notes on inputs."""

import errno
import json
import os
import re
from pathlib import Path

import click
import numpy as np
import pytest
from helpers.patience import within
from PIL import Image
from typer.main import get_command
from typer.testing import CliRunner

from fedavg.cli.app import app
from fedavg.models.registry import build_model
from fedavg.run import checkpoint
from fedavg.use.inputs import input_notes

runner = CliRunner()
META = {
    "model": {"name": "mlp", "input_shape": [1, 8, 8], "num_classes": 10, "args": {}},
    "classes": [str(i) for i in range(10)],
    "input": {"shape": [1, 8, 8], "dtype": "uint8", "scale": 1 / 255, "mean": [0.3],
              "std": [0.4]},
    "dataset": {"source": "digits", "seed": 0, "test_fraction": 0.2,
                "columns": {"image": None, "label": None}},
}


def test_version():
    import flwr

    import fedavg

    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0
    assert res.output.strip().startswith(f"fedavg {fedavg.__version__}")
    assert f"flwr {flwr.__version__}" in res.output


@pytest.mark.parametrize("command", ["simulate", "coordinator", "node", "merge", "evaluate",
                                     "predict", "certs"])
def test_every_option_has_a_help_text(command):
    cmd = get_command(app).commands[command]
    shown = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"}).output
    assert "_A_PATH" not in shown and "PATH" in shown  # a path's type, not a parser's name
    missing = [p.name for p in cmd.params if isinstance(p, click.Option) and not p.help]
    assert not missing, f"{command}: options without help: {missing}"
    assert cmd.help, f"{command} has no description"


def test_coordinator_takes_the_training_options_of_simulate():
    options = {c: {p.name for p in get_command(app).commands[c].params}
               for c in ("simulate", "coordinator")}
    shared = options["simulate"] - {"num_nodes", "cpus_per_node", "gpus_per_node", "verbose",
                                    "ray_address"}
    assert shared <= options["coordinator"], shared - options["coordinator"]
    assert {"mu", "server_lr", "local_epochs", "alpha", "verbose"} <= options["coordinator"]


def test_merge_lists_only_options_of_strategies_that_merge_saved_models():
    options = {p.name for p in get_command(app).commands["merge"].params}
    assert {"distill_steps", "ensemble_weights", "beta", "num_malicious"} <= options
    assert not {"mu", "moon_mu", "temperature", "alpha_dyn"} & options  # node training only
    assert not {"server_lr", "server_momentum", "tau"} & options  # steps from a round's start
    simulate = {p.name for p in get_command(app).commands["simulate"].params}
    assert {"mu", "moon_mu", "temperature", "alpha_dyn", "server_lr", "tau"} <= simulate


@pytest.mark.parametrize("width", [60, 80, 200])
def test_strategies_table_reads_whole_at_any_width(width):
    import strategies

    res = runner.invoke(app, ["strategies"], env={"COLUMNS": str(width)})
    assert res.exit_code == 0
    assert "…" not in res.output  # nothing cut off
    flat = " ".join(res.output.replace("│", " ").split())
    for name, cls in strategies.available().items():
        assert name in flat
        for opt in cls.options:
            assert opt.flag in flat.replace(" ", "") or opt.flag in flat, (name, opt.flag)
    assert "also takes --swa-start R" in flat  # the run-level averaging, for every strategy


def test_long_lines_are_not_broken_in_a_log_file(tmp_path):
    from fedavg.cli import app as cli

    assert cli.console.soft_wrap and cli.err_console.soft_wrap


def _image(path, size, mode="L"):
    shape = (size, size) if mode == "L" else (size, size, 3)
    Image.fromarray((np.random.default_rng(0).random(shape) * 255).astype("uint8"),
                    mode).save(path)
    return path


def test_resize_and_channel_notes(tmp_path):
    shape = (1, 8, 8)
    same = _image(tmp_path / "same.png", 8)
    small_change = _image(tmp_path / "twelve.png", 12)  # 1.5x: no note
    big = _image(tmp_path / "mnist.png", 28)
    colour = _image(tmp_path / "colour.png", 8, "RGB")
    assert input_notes([same, small_change], shape) == []
    notes = input_notes([same, big, colour], shape)
    assert len(notes) == 2
    assert "1 of 3 image(s) resized by more than 2x" in notes[0]
    assert "mnist.png is 28x28" in notes[0]
    assert "converted from colour to grey" in notes[1] and "colour.png" in notes[1]
    grey_for_colour = input_notes([same], (3, 8, 8))
    assert len(grey_for_colour) == 1 and "grey to colour" in grey_for_colour[0]


def test_predict_prints_the_note_once(tmp_path):
    model = checkpoint.save(tmp_path / "model", build_model("mlp", (1, 8, 8), 10).state_dict(),
                            META)
    images = [_image(tmp_path / f"big{i}.png", 28) for i in range(3)]
    terminal = {"TTY_COMPATIBLE": "1"}  # rich's own switch: print as to a terminal
    narrow = runner.invoke(app, ["predict", str(model), *map(str, images)],
                           env={"COLUMNS": "60", **terminal})
    assert narrow.exit_code == 0 and "┃ input" in narrow.stdout
    assert "…" not in narrow.stdout  # long paths fold, not cut
    res = runner.invoke(app, ["predict", str(model), *map(str, images)],
                        env={"COLUMNS": "400", **terminal})
    assert res.exit_code == 0, res.output
    assert res.stderr.count("note:") == 1
    assert "3 of 3 image(s) resized" in res.stderr
    for path in images:
        assert path.name in res.stdout


def test_predictions_from_nan_outputs_are_noted(tmp_path):
    """They came out as class 0 at confidence nan, with no word."""
    import csv

    net = build_model("mlp", (1, 8, 8), 10)
    state = net.state_dict()
    first = next(k for k in state if k.endswith("weight"))
    state[first][0, :] = 3e38  # finite weights (loaded), an infinite unit: NaN logits
    model = checkpoint.save(tmp_path / "model", state, META)
    images = [_image(tmp_path / f"img{i}.png", 8) for i in range(3)]
    res = runner.invoke(app, ["predict", str(model), *map(str, images), "--output", "-"])
    assert res.exit_code == 0, res.output
    assert "note: 3 of 3 prediction(s) come from NaN or infinite model outputs" in res.stderr
    rows = list(csv.DictReader(res.stdout.splitlines()))
    assert [row["confidence"] for row in rows] == ["nan"] * 3
    healthy = checkpoint.save(tmp_path / "ok", build_model("mlp", (1, 8, 8), 10).state_dict(),
                              META)
    res = runner.invoke(app, ["predict", str(healthy), *map(str, images), "--output", "-"])
    assert res.exit_code == 0 and "note:" not in res.stderr


def test_predict_piped_writes_every_prediction_as_csv(tmp_path):
    import csv

    model = checkpoint.save(tmp_path / "model", build_model("mlp", (1, 8, 8), 10).state_dict(),
                            META)
    images = [_image(tmp_path / f"img{i:02d}.png", 8) for i in range(60)]  # more than a table
    res = runner.invoke(app, ["predict", str(model), *map(str, images)],
                        env={"TTY_COMPATIBLE": "0"})
    assert res.exit_code == 0, res.output
    rows = list(csv.DictReader(res.stdout.splitlines()))
    assert [row["input"] for row in rows] == [str(p) for p in images]
    assert set(rows[0]) == {"input", "prediction", "class_index", "confidence"}
    assert all(row["prediction"] == META["classes"][int(row["class_index"])] for row in rows)


def test_predict_output_dash_writes_csv_on_stdout_even_on_a_terminal(tmp_path):
    import csv

    model = checkpoint.save(tmp_path / "model", build_model("mlp", (1, 8, 8), 10).state_dict(),
                            META)
    images = [_image(tmp_path / f"img{i:02d}.png", 8) for i in range(55)]
    res = runner.invoke(app, ["predict", str(model), *map(str, images), "--output", "-"],
                        env={"TTY_COMPATIBLE": "1"})
    assert res.exit_code == 0, res.output
    rows = list(csv.DictReader(res.stdout.splitlines()))
    assert [row["input"] for row in rows] == [str(p) for p in images]  # all 55, no table
    assert not (Path.cwd() / "-").exists()


def test_an_image_given_and_in_a_given_folder_is_predicted_once(tmp_path):
    from fedavg.use.inference import predict

    model = checkpoint.save(tmp_path / "model", build_model("mlp", (1, 8, 8), 10).state_dict(),
                            META)
    (tmp_path / "imgs").mkdir()
    a = _image(tmp_path / "imgs" / "a.png", 8)
    _image(tmp_path / "imgs" / "b.png", 8)
    again = tmp_path / "imgs" / ".." / "imgs" / "b.png"  # another spelling of b.png
    rows = predict(model, [str(a), str(tmp_path / "imgs"), str(again)])
    assert sorted(Path(r["input"]).name for r in rows) == ["a.png", "b.png"]
    assert Path(rows[0]["input"]) == a  # in the order given
    (tmp_path / "imgs" / "labels.json").write_text('{"a.png": "3"}')  # a stray annotation
    (tmp_path / "imgs" / "info.csv").write_text("name,label\na.png,3\n")
    rows = predict(model, [str(tmp_path / "imgs")])  # was read as a dataset, and refused
    assert sorted(Path(r["input"]).name for r in rows) == ["a.png", "b.png"]
    (tmp_path / "imgs" / "._a.png").write_bytes(b"\x00\x05\x16\x07 resource fork")  # macOS
    (tmp_path / "imgs" / ".git").mkdir()
    _image(tmp_path / "imgs" / ".git" / "c.png", 8)
    rows = predict(model, [str(tmp_path / "imgs")])  # hidden files and folders: left aside
    assert sorted(Path(r["input"]).name for r in rows) == ["a.png", "b.png"]


def test_evaluate_names_the_dataset_alike_in_text_and_json(tmp_path, monkeypatch):
    from fedavg.data.load import load

    data = load("digits", seed=0)
    for i in range(40):  # an image folder: one subfolder per class
        label = str(data.train.y[i])
        (tmp_path / "ds" / label).mkdir(parents=True, exist_ok=True)
        Image.fromarray(data.train.x[i, 0]).save(tmp_path / "ds" / label / f"{i}.png")
    model = checkpoint.save(tmp_path / "m", build_model("mlp", (1, 8, 8), 10).state_dict(),
                            META)
    monkeypatch.chdir(tmp_path)
    text = runner.invoke(app, ["evaluate", str(model), "--dataset", "ds"])
    as_json = runner.invoke(app, ["evaluate", str(model), "--dataset", "ds", "--json"])
    assert text.exit_code == 0 and as_json.exit_code == 0, text.output + as_json.output
    shown = json.loads(as_json.stdout)["dataset"]
    assert shown == str((tmp_path / "ds").resolve())
    assert text.stdout.startswith(shown + " [test]")


def test_certs_in_a_git_work_tree_warn_about_private_keys(tmp_path, tmp_path_factory):
    import subprocess

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    res = runner.invoke(app, ["certs", str(tmp_path / "certs")])
    assert res.exit_code == 0, res.output
    assert "inside the git work tree" in res.stderr and "out of version control" in res.stderr
    (tmp_path / ".gitignore").write_text("keys/\n")
    ignored = runner.invoke(app, ["certs", str(tmp_path / "keys")])
    assert ignored.exit_code == 0 and "git work tree" not in ignored.stderr
    plain = tmp_path_factory.mktemp("plain")
    outside = runner.invoke(app, ["certs", str(plain / "c")])
    assert outside.exit_code == 0
    # pytest's folders sit outside any work tree, unless TMPDIR is inside a checkout: then
    # the warning is right there too
    in_a_checkout = any((p / ".git").exists() for p in plain.parents)
    assert ("git work tree" in outside.stderr) == in_a_checkout, outside.stderr


def test_merges_in_a_row_get_folders_of_their_own(tmp_path, monkeypatch):
    for i in range(2):
        torch_state = build_model("mlp", (1, 8, 8), 10).state_dict()
        checkpoint.save(tmp_path / "nodes" / f"node-{i}", torch_state,
                        {**META, "node": {"num_examples": 10, "partition_id": i}})
    monkeypatch.chdir(tmp_path)
    outputs = set()
    for _ in range(2):
        res = runner.invoke(app, ["merge", "nodes"], env={"COLUMNS": "300"})
        assert res.exit_code == 0, res.output
        outputs.add(res.output.split(" into ")[1].split()[0])
    assert len(outputs) == 2 and all(o.startswith("runs/merged-") for o in outputs)


def test_ctrl_c_and_sigterm_share_one_handler():
    """The end-to-end tests send one of the two signals each; both reach the same handler."""
    import signal

    from fedavg.cli.support import on_signal

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        on_signal("stopping", cleanup=lambda: None)
        handler = signal.getsignal(signal.SIGINT)
        assert callable(handler) and handler is signal.getsignal(signal.SIGTERM)
        assert handler not in saved.values()
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_a_signal_inside_an_import_still_stops_with_130(monkeypatch, capfd):
    """A signal inside an import still stops the engine and exits 130.

    SIGTERM landing while rich loads its emoji table made the handler's own print fail on
    the half-made module: exit 1 and no cleanup. The message falls back to plain stderr.
    """
    import signal

    from fedavg.cli import support as cli_support

    def half_imported(*args, **kwargs):
        raise ImportError("cannot import name 'EMOJI' from partially initialized module")

    def exit_(code):
        raise SystemExit(code)

    cleaned = []
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setattr(cli_support.err_console, "print", half_imported)
    monkeypatch.setattr(cli_support.console, "quiet", False)
    monkeypatch.setattr(cli_support.os, "_exit", exit_)
    try:
        cli_support.on_signal("interrupted: finished rounds are kept",
                              cleanup=lambda: cleaned.append(True))
        with pytest.raises(SystemExit) as stopped:
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert stopped.value.code == 130
    assert cleaned == [True]
    assert capfd.readouterr().err == "interrupted: finished rounds are kept\n"


def test_a_stop_whose_message_fails_still_cleans_up_and_exits_130(monkeypatch):
    """A message or a stderr that fails still stops the engine and exits 130.

    A message that cannot be made, and a stderr that cannot be written (a lost terminal, a
    write already in progress on it) both used to raise out of the handler, into whatever
    the main thread ran: exit code 1 and no cleanup.
    """
    import signal

    from fedavg.cli import support as cli_support

    def broken(*args, **kwargs):
        raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stderr>'>")

    def no_message():
        raise FileNotFoundError("checkpoint.safetensors")

    def exit_(code):
        raise SystemExit(code)

    cleaned, said = [], []
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setattr(cli_support.err_console, "print", broken)
    monkeypatch.setattr(cli_support.sys, "stderr", type("W", (), {"write": broken,
                                                                  "flush": broken})())
    monkeypatch.setattr(cli_support.os, "write", lambda fd, data: said.append((fd, data)))
    monkeypatch.setattr(cli_support.console, "quiet", False)
    monkeypatch.setattr(cli_support.os, "_exit", exit_)
    try:
        cli_support.on_signal(no_message, cleanup=lambda: cleaned.append(True))
        with pytest.raises(SystemExit) as stopped:
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert stopped.value.code == 130
    assert cleaned == [True]
    assert said == [(2, b"interrupted\n")]  # the plain word, straight to file descriptor 2


def test_a_terminal_that_hung_up_mid_run_costs_no_round(monkeypatch):
    """A round line printed into a terminal that hung up (EIO) is dropped; the run goes on.

    Under load the engine's thread printed its round line before the hangup's SIGHUP
    reached the main thread: the write's EIO ended the run with exit code 1, not 130.
    """
    import errno as errno_

    from fedavg.cli import support as cli_support

    class HungUp:

        def write(self, text):
            raise OSError(errno_.EIO, "Input/output error")

        def flush(self):
            pass

        def isatty(self):
            return True

    detached = []
    monkeypatch.setattr("fedavg.util.interrupts.detach_lost_terminal",
                        lambda: detached.append(True))
    console = cli_support._Console(file=HungUp(), force_terminal=True)
    console.print("round   2/50: accuracy 0.9")  # raised OSError before
    console.print("round   3/50: accuracy 0.9")
    assert console.quiet and detached == [True]
    other = cli_support._Console(file=HungUp())
    monkeypatch.setattr(HungUp, "write", lambda self, text: (_ for _ in ()).throw(
        OSError(errno_.ENOSPC, "No space left on device")))
    with pytest.raises(OSError, match="No space"):  # any other failure is still said
        other.print("x")


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (its ``SigCgt`` mask in /proc)."""
    with open(f"/proc/{pid}/status") as status:
        mask = next(line for line in status if line.startswith("SigCgt:")).split()[1]
    return bool(int(mask, 16) >> (sig - 1) & 1)


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_while_the_cli_still_imports_is_one_line_and_exit_130(tmp_path, sig):
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    script = Path(sys.executable).parent / "fedavg"  # the console script, as a user runs it
    # as from a terminal: a shell's background job (tests run with `&`) ignores SIGINT, and
    # so would the CLI it starts
    proc = subprocess.Popen([str(script), "simulate", "--output", str(tmp_path / "run")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # the signal goes once the CLI holds interrupts (it catches SIGTERM, which Python itself
    # never does), while torch and Flower still import: a fixed sleep may be too early
    deadline = time.monotonic() + within(60)
    while not _catches(proc.pid, signal.SIGTERM):
        assert proc.poll() is None and time.monotonic() < deadline, "never held interrupts"
        time.sleep(0.005)
    proc.send_signal(getattr(signal, sig))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == ["interrupted before the command started"], err


def test_columns_zero_still_prints():
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "fedavg.cli", "strategies"],
    capture_output=True,
                         text=True, timeout=120, env={**os.environ, "COLUMNS": "0"})
    assert out.returncode == 0 and "fedavg" in out.stdout and "fedprox" in out.stdout


def test_sigterm_in_a_command_without_a_handler_of_its_own_is_like_ctrl_c(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "app.py"
    script.write_text(
        "import os, signal, time, typer\n"
        "from fedavg.cli.support import guard, run_app\n"
        "app = typer.Typer()\n"
        "@app.command()\n"
        "def work():\n"
        "    with guard('interrupted: nothing was written'):\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        time.sleep(30)\n"
        "@app.command()\n"
        "def other():\n"
        "    pass\n"
        "run_app(app)\n")
    proc = subprocess.run([sys.executable, str(script), "work"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip() == "interrupted: nothing was written"


def test_interrupts_during_imports_are_held_until_the_block_ends():
    import os
    import signal
    import threading

    from fedavg.util.interrupts import held_interrupts

    reached, before = [], signal.signal(signal.SIGINT, signal.default_int_handler)
    try:  # Ctrl-C as a shell gives it (a test worker may ignore SIGINT)
        with pytest.raises(KeyboardInterrupt):
            with held_interrupts():
                os.kill(os.getpid(), signal.SIGINT)  # an import cut here would stay broken
                reached.append("end of block")
        assert reached == ["end of block"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    finally:
        signal.signal(signal.SIGINT, before)
    with held_interrupts(raise_after=False) as held:
        os.kill(os.getpid(), signal.SIGTERM)
    assert held == [signal.SIGTERM]
    outside = []  # in another thread signals are not delivered: the block just runs
    thread = threading.Thread(target=lambda: outside.append(
        held_interrupts().__enter__() == []))
    thread.start()
    thread.join()
    assert outside == [True]


def test_evaluate_and_predict_fit_a_dataset_of_other_images_to_the_model(tmp_path):
    """A 12x12 colour image folder or table for an 8x8 grey model: converted, with a note."""
    import datasets

    from fedavg.use.inference import evaluate_model, evaluation_data, predict

    model = checkpoint.save(tmp_path / "model", build_model("mlp", (1, 8, 8), 10).state_dict(),
                            META)
    values = {"3": 30, "7": 200}
    for label, value in values.items():
        (tmp_path / "imgs" / label).mkdir(parents=True)
        for k in range(3):
            Image.fromarray(np.full((12, 12, 3), value + k, np.uint8)).save(
                tmp_path / "imgs" / label / f"{k}.png")
    folder = str(tmp_path / "imgs")
    _, data, _, part = evaluation_data(META, model, folder)
    assert data.splits["test"].x.shape[1:] == (3, 12, 12)
    assert part.x.shape == (6, 1, 8, 8) and part.x.dtype == np.uint8
    for x, y in zip(part.x, part.y):  # grey of (v, v, v) is v, and a flat image stays flat
        value = values[META["classes"][y]]
        assert value <= x.min() == x.max() < value + 3
    res = evaluate_model(model, folder)
    assert res["num_examples"] == 6
    assert res["notes"] == ["the test split's inputs are 12x12 colour images, the model takes "
                            "8x8 grey ones: they were converted and resized; results may be "
                            "unreliable: use images like the training data"]
    table = tmp_path / "imgs.parquet"
    datasets.Dataset.from_dict({
        "image": [Image.fromarray(np.full((8, 8, 3), 9, np.uint8)) for _ in range(4)],
        "label": ["3", "7", "3", "7"]}).cast_column("image", datasets.Image()).to_parquet(table)
    notes = []
    rows = predict(model, [str(table)], on_note=notes.append)
    assert [r["input"] for r in rows] == [f"{table}#row{i}" for i in range(4)]
    assert notes == [f"{table}'s test inputs are 8x8 colour images, the model takes 8x8 grey "
                     "ones: they were converted; results may be unreliable: use images like "
                     "the training data"]


def test_messages_keep_colon_words_as_written(capsys):
    """Rich turned ``:ok:`` in a path such as ``m/b.py:ok:extra`` into an emoji."""
    from fedavg.cli.support import console, err_console

    err_console.print("model m/b.py:ok:extra")
    console.print("file :smile:.csv")
    out = capsys.readouterr()
    assert "m/b.py:ok:extra" in out.err and ":smile:.csv" in out.out


def test_what_model_code_prints_goes_to_stderr_not_into_json_or_csv(tmp_path):
    import csv
    import json

    code = tmp_path / "pr.py"
    code.write_text("from torch import nn\n\ndef printer(input_shape, num_classes):\n"
                    "    print('HELLO FROM BUILDER')\n"
                    "    return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))\n")
    spec = {**META["model"], "name": f"{code}:printer"}
    state = build_model(f"{code}:printer", (1, 8, 8), 10).state_dict()
    model = checkpoint.save(tmp_path / "model", state, {**META, "model": spec})
    res = runner.invoke(app, ["evaluate", str(model), "--json", "--model", f"{code}:printer"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["num_examples"] == 359  # stdout is the JSON alone
    assert "HELLO FROM BUILDER" in res.stderr
    res = runner.invoke(app, ["predict", str(model), "digits", "--model", f"{code}:printer"],
                        env={"TTY_COMPATIBLE": "0"})
    assert res.exit_code == 0, res.output
    assert len(list(csv.DictReader(res.stdout.splitlines()))) == 359
    assert "HELLO" not in res.stdout and "HELLO FROM BUILDER" in res.stderr


def test_a_full_or_read_only_disk_is_a_failed_run_in_one_line(capsys):
    """It was a traceback (OSError, or safetensors' own error) with no resume hint."""
    import typer

    from fedavg.cli.support import guard
    from fedavg.util.errors import RunError

    for exc, said in (
        (OSError(errno.EROFS, "Read-only file system", "/r/summary.json"),
         "/r/summary.json: Read-only file system"),
        (PermissionError(errno.EACCES, "Permission denied", "/r/model.json"),
         "/r/model.json: Permission denied"),
        (RunError("cannot write /r/model.safetensors: No space left on device"),
         "/r/model.safetensors: No space left on device")):
        verb = "access" if "Permission" in said else "write"  # it may have been a read
        for failed in ("run failed", "merge failed", "error"):  # as the command names it
            with pytest.raises(typer.Exit) as stopped, guard(failed=failed):
                raise exc
            assert stopped.value.exit_code == 1
            assert capsys.readouterr().err.strip() == f"{failed}: cannot {verb} {said}"
    with pytest.raises(FileNotFoundError), guard():  # not about the disk: a bug, kept whole
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", "x")


class SafetensorError(Exception):
    """safetensors' error type, known by its name (a Rust error)."""


@pytest.mark.parametrize("exc, why", [
    (OSError(errno.ENOSPC, "No space left on device", "/r/.model.safetensors.x.tmp"),
     "No space left on device"),
    (SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                     'message: "No space left on device" })'), "No space left on device"),
    (SafetensorError("Error while serializing: I/O error: Read-only file system (os error 30)"),
     "Read-only file system")])
def test_a_file_the_disk_has_no_room_for_is_named_and_the_old_one_kept(tmp_path, exc, why):
    """The writer names the file itself, not its half-written copy nor "the model file"."""
    from fedavg.util.atomic import atomic_write
    from fedavg.util.errors import RunError

    path = tmp_path / "model.safetensors"
    path.write_text("round 3")

    def _write(tmp):
        Path(tmp).write_text("half of round 4")
        raise exc

    with pytest.raises(RunError, match=f"^cannot write {re.escape(str(path))}: {why}$"):
        atomic_write(path, _write)
    assert path.read_text() == "round 3" and os.listdir(tmp_path) == ["model.safetensors"]
    with pytest.raises(SafetensorError):  # another error of safetensors: not the disk
        atomic_write(path, lambda tmp: (_ for _ in ()).throw(SafetensorError("bad dtype")))


def test_a_sigint_ignored_at_start_stays_ignored():
    """A script's background job (`fedavg simulate ... &`) starts with SIGINT ignored.

    fedavg installed its own handlers over that, so a Ctrl-C meant for the script stopped
    the job too (exit 130). SIGTERM still stops it.
    """
    import signal

    from fedavg.cli import support as cli_support
    from fedavg.util.interrupts import held_interrupts, stoppers

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup starts it: it stays so
        assert signal.SIGHUP not in stoppers()
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        assert stoppers() == (signal.SIGTERM, signal.SIGHUP)
        with held_interrupts(raise_after=False) as held:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            signal.raise_signal(signal.SIGINT)  # ignored: not held, not raised later
        assert held == []
        cli_support.on_signal("stopped", cleanup=lambda: None)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_IGN, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as Python starts
        assert stoppers() == (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
