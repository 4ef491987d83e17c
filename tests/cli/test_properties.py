"""Property-based tests: random settings, command lines and partition parameters.

Each property says: the input either works, or fails with our :class:`UserError` (on the
command line: one ``error:`` line and exit code 2), never with another exception. No
property starts a run: the commands stop at the first step after their checks.
``max_examples`` below is the number of random inputs tried per property.
"""

import logging
import math
import os
import signal

import numpy as np
import pytest
import typer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import strategies as merge_strategies
from fedavg.cli.app import build_app
from fedavg.config.settings import MAX_SEED, RunConfig
from fedavg.data.partition import partition, partitioner_names
from fedavg.util.errors import UserError

EXAMPLES = {"config": 300, "cli": 120, "partition": 300}
QUICK = dict(deadline=None, derandomize=True, database=None,
             suppress_health_check=[HealthCheck.too_slow])

# --- random values ------------------------------------------------------------------------------

NUMBERS = st.one_of(
    st.integers(min_value=-(2**40), max_value=2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 0.0, 0.5, 1.0, 1.5, 2**31, 2**31 - 1, 10**30, math.inf,
                     -math.inf, math.nan, 1e300, "inf", "nan", "1e999", "-0"]),
)
NAMES = st.sampled_from(["fedavg", "fedadam", "fedprox", "fedavgm", "average", "soup",
                         "greedy-soup", "distill", "ensemble", "krum", "iid", "dirichlet",
                         "pathological", "natural", "mlp", "cnn", "auto", "cpu", "cuda:0",
                         "digits", "", " ", "nope", "../x", "é", "0"])
TEXT = st.one_of(NAMES, st.text(max_size=12))
VALUES = st.one_of(NUMBERS, TEXT, st.booleans(), st.none())


def config_keys() -> list[str]:
    flat = RunConfig().to_flat()
    options = [k.replace("_", "-") for k in merge_strategies.all_options()]
    return sorted({*flat, "partition-by", "image-column", "label-column", "validation",
                   "distill-data", *options})


KEYS = config_keys()

# --- config -------------------------------------------------------------------------------------


@settings(max_examples=EXAMPLES["config"], **QUICK)
@given(st.dictionaries(st.one_of(st.sampled_from(KEYS), st.sampled_from(KEYS),
                                 st.text(max_size=8)), VALUES, max_size=4))
def test_any_settings_build_a_valid_config_or_say_why(flat):
    try:
        config = RunConfig.from_flat(flat).validate()
        strategy = config.build_strategy()
    except UserError as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    assert strategy is not None
    # a valid config survives its flat form (Flower's run_config) unchanged
    assert RunConfig.from_flat(config.to_flat()) == config
    assert 0 <= config.data.seed < MAX_SEED and config.merge.num_nodes >= 1
    assert 0 < config.merge.fraction <= 1 and config.local_training().lr > 0
    assert 1 <= config.nodes_per_round <= config.merge.num_nodes


@settings(max_examples=EXAMPLES["config"], **QUICK)
@given(st.sampled_from(KEYS), VALUES)
def test_replace_one_setting_keeps_or_refuses_it(key, value):
    try:
        config = RunConfig().replace(**{key: value}).validate()
    except UserError as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    if value is not None and key in RunConfig().to_flat():  # a field: stored as given
        stored = config.to_flat()[key]
        if isinstance(stored, float) and isinstance(value, (int, float)):
            assert math.isclose(stored, value)
        elif isinstance(value, str) and isinstance(stored, str):
            assert stored == value


# --- command line -------------------------------------------------------------------------------

REACHED = "options checked"  # what the stand-ins below raise once every check passed


def cli_arguments(command: str):
    """Random ``--option value`` lists for ``command``, built from its own parameters."""
    params = typer.main.get_command(build_app()).commands[command].params
    options = [p for p in params if p.opts and p.opts[0].startswith("--")
               and p.name not in ("output", "verbose", "models_opt")]

    def value_for(param):
        kind = param.type.name
        if kind == "integer":
            return st.one_of(st.integers(-5, 60), st.integers(), st.sampled_from(["x", "1.5"]))
        if kind == "float":
            return st.one_of(st.floats(-2, 5), st.floats(), st.sampled_from(["nan", "x"]))
        return TEXT

    def pairs(chosen):
        return st.tuples(*[st.just([]) if p.is_flag else value_for(p).map(lambda v: [str(v)])
                           for p in chosen]).map(
            lambda values: [a for p, v in zip(chosen, values) for a in [p.opts[0], *v]])

    return st.lists(st.sampled_from(options), max_size=6, unique_by=lambda p: p.name).flatmap(
        pairs)


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory):
    """Run in a fresh folder; undo what the commands set (signal handlers, env, logs)."""
    folder = tmp_path_factory.mktemp("cli")
    saved = ({s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)},
             dict(os.environ), logging.getLogger("flwr").level, os.getcwd())
    os.chdir(folder)
    yield folder
    handlers, env, level, cwd = saved
    os.chdir(cwd)
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    os.environ.clear()
    os.environ.update(env)
    logging.getLogger("flwr").setLevel(level)
    assert not (folder / "runs").exists(), "a run folder was created"


@pytest.fixture(scope="module")
def stand_ins():
    """Replace the run steps after the checks with a stop, so no run ever starts."""
    import fedavg.engines.deployment
    import fedavg.run.lifecycle
    from fedavg.engines.deployment import coordinator as deploy

    def prepare(config):  # simulate checks every option, then prepares: stop there
        raise UserError(REACHED)

    def coordinate(config, options, *, console=None, tracking=None):
        deploy._check_options(config, options)  # the coordinator's own checks, in full
        raise UserError(REACHED)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fedavg.run.lifecycle, "prepare", prepare)
        mp.setattr(deploy, "coordinate", coordinate)
        yield


def run_command(args: list[str]) -> tuple[int, str]:
    """Parse and check ``fedavg ARGS`` as the console script does: (exit code, stderr)."""
    import click

    result = CliRunner().invoke(build_app(), args, standalone_mode=False)
    if isinstance(result.exception, click.UsageError):  # the entry point prints it as one line
        return 2, f"error: {result.exception.format_message()}"
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"fedavg {' '.join(args)} raised {result.exception!r}")
    code = result.exit_code if result.exception is not None else (result.return_value or 0)
    return code, result.stderr


def assert_refused_in_one_line(code: int, stderr: str, args: list[str]) -> str:
    assert code == 2, (code, stderr, args)
    assert "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), (stderr, args)
    return lines[0]


@pytest.mark.parametrize("command", ["simulate", "coordinator", "merge"])
def test_random_command_lines_are_checked_or_refused_in_one_line(command, cli_env, stand_ins):
    tried, reached = [], []

    @settings(max_examples=EXAMPLES["cli"], **QUICK)
    @given(cli_arguments(command))
    def check(args):
        full = [command, *args] + (["./no-such-model"] if command == "merge" else [])
        if command == "coordinator" and "--certs" not in args:
            full.append("--insecure")  # else every line stops at "pass --certs or --insecure"
        line = assert_refused_in_one_line(*run_command(full), full)
        tried.append(full)
        reached.append(REACHED in line or "no such model folder: no-such-model" in line)

    check()
    assert len(tried) >= EXAMPLES["cli"] // 2
    assert any(reached) and not all(reached), "the random options never/always passed"


# --- partition parameters -----------------------------------------------------------------------


@st.composite
def partition_inputs(draw):
    n = draw(st.integers(1, 120))
    labels = np.asarray(draw(st.lists(st.integers(0, draw(st.integers(0, 9))),
                                      min_size=n, max_size=n)), dtype=np.int64)
    groups = draw(st.one_of(st.none(), st.lists(st.sampled_from(
        ["a", "b", "c", "d", "e", "f", "", "None", "nan", "w1", "w10", "w2"]),
        min_size=n, max_size=n)))
    return dict(
        labels=labels,
        num_partitions=draw(st.integers(-2, 25)),
        scheme=draw(st.one_of(st.sampled_from(partitioner_names()), st.text(max_size=6))),
        alpha=draw(st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                             st.sampled_from([1e-300, 1e-3, 0.1, 0.5, 1e6])).filter(
                                 lambda a: not 0 < a < 1e-3)),
        classes_per_node=draw(st.integers(-2, 12)),
        groups=None if groups is None else np.asarray(groups),
        seed=draw(st.integers(0, MAX_SEED - 1)),
    )


@settings(max_examples=EXAMPLES["partition"], **QUICK)
@given(partition_inputs())
def test_partition_is_valid_or_refused(kwargs):
    labels, num, scheme = kwargs["labels"], kwargs["num_partitions"], kwargs["scheme"]
    try:
        parts = partition(**kwargs)
    except UserError as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    n = len(labels)
    assert len(parts) == num
    everything = np.concatenate(parts)
    assert len(np.unique(everything)) == len(everything), "a sample is on two nodes"
    assert all(p.dtype == np.int64 and len(p) > 0 for p in parts), "an empty node"
    assert all(np.all(np.diff(p) > 0) for p in parts)
    assert everything.min() >= 0 and everything.max() < n
    if scheme != "pathological":  # pathological may leave out labels no node was given
        np.testing.assert_array_equal(np.sort(everything), np.arange(n))
    else:
        assert all(len(np.unique(labels[p])) <= kwargs["classes_per_node"] for p in parts)
    if scheme == "natural":
        groups = kwargs["groups"].astype(str)
        owner = {}
        for node, p in enumerate(parts):
            for value in set(groups[p]):
                assert owner.setdefault(value, node) == node, f"{value!r} on two nodes"
