"""Fuzz every command: odd values for every option and argument, in-process, no engine started.

Each case is ``fedavg COMMAND`` with random options and arguments drawn from odd values (0,
-1, nan, inf, huge integers, empty and very long strings, unicode, folders and devices
where files are expected, 0-byte, header-only and one-row data files, a damaged model).
Every case must end with exit code 0 (it worked) or 2 with one ``error:`` line and no
traceback. The steps after the checks are stand-ins, so no run, engine or process starts.

``FEDAVG_FUZZ_EXAMPLES`` sets the cases per command (default 40; the closing note of the
issue reports a run of 10,000 cases in all).
"""

import contextlib
import io
import logging
import os
import signal
import sys

import click
import pytest
import typer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from typer.testing import CliRunner

from fedavg.cli.app import build_app
from fedavg.models.registry import build_model
from fedavg.run import checkpoint
from fedavg.util.errors import UserError

EXAMPLES = int(os.environ.get("FEDAVG_FUZZ_EXAMPLES", "40"))
COMMANDS = ["simulate", "merge", "evaluate", "predict", "export", "strategies", "models",
            "coordinator", "node", "certs", "kubernetes", "sweep", "report"]
REACHED = "options checked"  # what the stand-ins raise once every check passed
META = {"model": {"name": "mlp", "input_shape": [1, 8, 8], "num_classes": 10, "args": {}},
        "classes": [str(i) for i in range(10)],
        "input": {"shape": [1, 8, 8], "dtype": "uint8", "scale": 1 / 255, "mean": [0.3],
                  "std": [0.4]}}

LONG = "x" * 300
ODD_TEXT = ["", " ", LONG, "ü✓ data", "a\nb", "-", "--", "0", "-1", "nan", "inf", "1e999",
            "~nobody-here/x", "\x00",
            "None", "folder/../..x", "digits", "auto", "cpu", "fedavg", "mlp", "hashed", "x=1",
            "{}"]
#: Files and folders made in the case folder (see ``place``); given as relative paths.
#: Every place is in the case folder (or a device): a command given a folder writes there.
PLACES = ["empty.csv", "header.csv", "one.csv", "junk.parquet", "junk.safetensors", "folder",
          "model", "damaged-model", "image.png", "sweep.toml", "missing", "/dev/null", ".",
          "folder/..", "~", "~/x"]
#: A valid value of each argument, drawn half the time so that cases get past it.
VALID = {"model_dir": "model", "models": "model", "run": "model", "inputs": "image.png",
         "config": "sweep.toml", "runs_dir": "folder"}
ODD_INTS = ["0", "-1", "1", "2", str(2**31), str(2**63), str(10**30), "1.5", "x", "", "nan"]
ODD_FLOATS = ["0", "-1", "0.5", "1", "nan", "inf", "-inf", "1e309", "1e-9", "x", "", "2"]


def place(folder):
    """Make the odd files and folders of :data:`PLACES` in ``folder``."""
    (folder / "empty.csv").write_bytes(b"")
    (folder / "header.csv").write_text("a,b,label\n")
    (folder / "one.csv").write_text("a,b,label\n1,2,x\n")
    (folder / "junk.parquet").write_bytes(os.urandom(64))
    (folder / "junk.safetensors").write_bytes(os.urandom(64))
    (folder / "folder").mkdir()
    model = checkpoint.save(folder / "model", build_model("mlp", (1, 8, 8), 10).state_dict(),
                            META)
    damaged = checkpoint.save(folder / "damaged-model",
                              build_model("mlp", (1, 8, 8), 10).state_dict(), META)
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    Image.new("L", (8, 8)).save(folder / "image.png")
    (folder / "sweep.toml").write_text('[base]\nrounds = 1\n[grid]\nseed = [0, 1]\n')
    return model


def value_for(param):
    """Odd values for one option or argument, by its type."""
    kind = param.type.name
    if kind == "integer":
        return st.sampled_from(ODD_INTS)
    if kind == "float":
        return st.sampled_from(ODD_FLOATS)
    if kind == "choice":
        return st.one_of(st.sampled_from(list(param.type.choices)), st.sampled_from(ODD_TEXT))
    return st.one_of(st.sampled_from(PLACES), st.sampled_from(ODD_TEXT), st.text(max_size=8))


def command_lines(command: str):
    """Random argument lists for ``command``, built from its own parameters."""
    params = typer.main.get_command(build_app()).commands[command].params
    options = [p for p in params if isinstance(p, click.Option) and p.opts[0] != "--help"]
    arguments = [p for p in params if isinstance(p, click.Argument)]

    def option_args(chosen):
        return st.tuples(*[st.just([p.opts[0]]) if p.is_flag else
                           value_for(p).map(lambda v, p=p: [p.opts[0], v]) for p in chosen]
                         ).map(lambda pairs: [a for pair in pairs for a in pair])

    def argument_values(p):
        many = p.nargs == -1
        odd = value_for(p)
        values = st.one_of(st.just(VALID[p.name]), odd) if p.name in VALID else odd
        return st.lists(values, min_size=0 if many else 1, max_size=3 if many else 1)

    positional = st.tuples(*[argument_values(p) for p in arguments]).map(
        lambda lists: [v for values in lists for v in values])
    named = st.lists(st.sampled_from(options), max_size=5, unique_by=lambda p: p.name).flatmap(
        option_args) if options else st.just([])
    return st.tuples(positional, named).map(lambda both: [*both[1], "--", *both[0]]
                                            if any(v.startswith("-") for v in both[0])
                                            else [*both[1], *both[0]])


@pytest.fixture(scope="module")
def case_folder(tmp_path_factory):
    """Run in a fresh folder holding the odd files; undo what the commands set."""
    folder = tmp_path_factory.mktemp("fuzz")
    saved = ({s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)},
             dict(os.environ), logging.getLogger("flwr").level, os.getcwd())
    outside = {p: sorted(os.listdir(p)) for p in ("/", folder.parent)}
    os.chdir(folder)
    os.environ["HOME"] = str(folder)  # `~` is the case folder too
    place(folder)
    yield folder
    assert {p: sorted(os.listdir(p)) for p in outside} == outside, "wrote outside its folder"
    handlers, env, level, cwd = saved
    os.chdir(cwd)
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    os.environ.clear()
    os.environ.update(env)
    logging.getLogger("flwr").setLevel(level)


@pytest.fixture(scope="module")
def stand_ins():
    """Replace every step after the checks that would start a run, engine or process."""
    import fedavg.engines.deployment.gpus as gpus
    import fedavg.engines.deployment.node as deployed_node
    import fedavg.engines.deployment.processes as processes
    import fedavg.engines.simulation.simulate as simulation
    import fedavg.run.lifecycle
    import fedavg.sweeps.runner as runner
    from fedavg.engines.deployment import coordinator as deploy

    def reached(*args, **kwargs):
        raise UserError(REACHED)

    def coordinate(config, options, *, console=None, tracking=None):
        deploy._check_options(config, options)  # the coordinator's own checks, in full
        raise UserError(REACHED)

    def serve_node(options, console=None):
        options.check()
        raise UserError(REACHED)

    def started(*args, **kwargs):
        raise AssertionError("a process was started")

    def leave(code=0):  # `fedavg node` ends with os._exit: here, an exit code
        raise SystemExit(code)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fedavg.run.lifecycle, "prepare", reached)
        mp.setattr(simulation, "_run_on_ray", reached)
        mp.setattr(deploy, "coordinate", coordinate)
        mp.setattr(deployed_node, "serve_node", serve_node)
        mp.setattr(gpus, "serve_gpu_nodes", lambda gpus, options, console=None: serve_node(
            options))
        mp.setattr(processes, "start_command", started)
        mp.setattr(runner.Runner, "run", reached)
        mp.setattr(os, "_exit", leave)
        yield


def run_command(args: list[str]) -> tuple[int, str]:
    """Run ``fedavg ARGS`` in-process as the console script does: (exit code, stderr)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = CliRunner().invoke(build_app(), args, standalone_mode=False)
    if isinstance(result.exception, click.UsageError):  # the entry point prints it as one line
        return 2, f"error: {result.exception.format_message()}"
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"fedavg {' '.join(map(repr, args))} raised "
                             f"{result.exception!r}") from result.exception
    code = result.exit_code if result.exception is not None else (result.return_value or 0)
    return code, result.stderr


def check_case(args: list[str]) -> str:
    """Run one case; fail unless it worked or was refused in one line; return its outcome."""
    code, stderr = run_command(args)
    assert "Traceback" not in stderr, (args, stderr)
    if code == 0:
        return "worked"
    assert code == 2, (args, code, stderr)
    lines = [line for line in stderr.splitlines()  # notes may come before the refusal
             if line.strip() and not line.startswith("note:")]
    assert len(lines) == 1 and lines[0].startswith("error:"), (args, stderr)
    return "reached" if REACHED in lines[0] else "refused"


@pytest.mark.parametrize("command", COMMANDS)
def test_odd_values_are_refused_in_one_line_or_work(command, case_folder, stand_ins):
    outcomes = []

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(command_lines(command))
    def case(args):
        outcomes.append(check_case([command, *args]))

    case()
    assert outcomes  # (a command without options has one case: itself)
    assert not any(p.startswith("ray") for p in os.listdir(case_folder)), "Ray was started"
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()
    counts = {k: outcomes.count(k) for k in ("worked", "reached", "refused")}
    print(f"fuzz {command}: {len(outcomes)} cases, {counts}")
