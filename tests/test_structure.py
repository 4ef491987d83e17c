"""The shape of the code: a new strategy, or a new node option, is one declaration plus its use.

The throwaway strategy below lives in this file only. Registering it is all it takes for its
option to appear in ``fedavg simulate --help`` and in the docs site's references, and to reach
its merge in a real run.
"""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import strategies
from strategies.fedavg import FedAvg

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def scaled_strategy(monkeypatch):
    """Register ``test-scaled`` for one test; the registry is restored afterwards.

    ``test-scaled`` is FedAvg, then every float tensor times ``--scale``.
    """
    monkeypatch.setattr(strategies.base, "_REGISTRY", dict(strategies.base._REGISTRY))
    seen: list[float] = []

    @strategies.register
    class Scaled(FedAvg):
        name = "test-scaled"
        description = "FedAvg, then scaled (test only)"
        paper = "none"
        options = (strategies.Option("scale", float, 1.0, "Factor applied after averaging"),)

        def check(self) -> None:
            if not self.scale > 0:
                raise ValueError(f"--scale must be > 0 (got {self.scale})")

        def result(self):
            merged = super().result()
            seen.append(self.scale)
            merged.state_dict = {k: v * self.scale if v.is_floating_point() else v
                                 for k, v in merged.state_dict.items()}
            return merged

    return seen


def _app():
    from fedavg.cli.app import build_app

    return build_app()


def test_a_new_strategy_option_is_declared_once(scaled_strategy):
    runner = CliRunner()
    for command in ("simulate", "coordinator", "merge"):
        res = runner.invoke(_app(), [command, "--help"], env={"COLUMNS": "200"})
        assert res.exit_code == 0, res.output
        assert "--scale" in res.output and "test-scaled 1.0" in res.output, command
    assert strategies.get("test-scaled", scale=3.0).scale == 3.0
    assert "test-scaled" in runner.invoke(_app(), ["strategies"],
                                          env={"COLUMNS": "300"}).output


def test_a_new_strategy_and_its_option_appear_in_the_built_docs(scaled_strategy, tmp_path):
    from helpers.docs_site import build_site, page

    site = build_site(tmp_path / "site")
    strategies_page = page(site, "reference/strategies")
    assert 'id="test-scaled"' in strategies_page
    assert "FedAvg, then scaled (test only)" in strategies_page
    assert "Factor applied after averaging" in strategies_page
    # an option of simulate, coordinator and merge
    assert "<code>--scale</code>" in page(site, "reference/cli")


def test_an_option_the_strategy_does_not_take_is_one_line(scaled_strategy):
    res = CliRunner().invoke(_app(), ["simulate", "--strategy", "fedavg", "--scale", "2"])
    assert res.exit_code == 2
    assert "strategy fedavg does not take --scale" in res.output
    assert "Traceback" not in res.output
    res = CliRunner().invoke(_app(), ["simulate", "--strategy", "test-scaled", "--scale", "-1"])
    assert res.exit_code == 2 and "--scale must be > 0" in res.output
    res = CliRunner().invoke(_app(), ["simulate", "--strategy", "fedprox", "--tau", "0.1"])
    assert res.exit_code == 2 and "fedprox does not take --tau (it takes --mu)" in res.output


@pytest.mark.e2e
def test_a_new_strategy_option_reaches_its_merge(scaled_strategy, tmp_path, no_leaks):
    from fedavg.run import checkpoint

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        res = CliRunner().invoke(_app(), [
            "simulate", "--strategy", "test-scaled", "--scale", "0.5", "--rounds", "1",
            "--num-nodes", "2", "--output", str(tmp_path / "run")])
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert res.exit_code == 0, res.output
    assert scaled_strategy == [0.5]
    state, meta = checkpoint.load(tmp_path / "run")
    assert meta["config"]["merge"]["options"] == {"scale": 0.5}
    assert meta["strategy"] == "test-scaled"
    assert all(torch.isfinite(v).all() for v in state.values())


PLUGIN = '''
from strategies.base import Option, register
from strategies.fedavg import FedAvg


@register
class Halved(FedAvg):
    name = "plugin-halved"
    description = "FedAvg, then halved (a plugin)"
    paper = "none"
    options = (Option("plugin_factor", float, 0.5, "Factor after averaging"),)
'''


def test_an_installed_package_adds_a_strategy_through_its_entry_point(tmp_path):
    import os
    import subprocess
    import sys

    (tmp_path / "my_plugin.py").write_text(PLUGIN)
    info = tmp_path / "my_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[fedavg.strategies]\nhalved = my_plugin\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "COLUMNS": "200"}
    listed = subprocess.run([sys.executable, "-m", "fedavg.cli", "strategies"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert "plugin-halved" in listed.stdout and "--plugin-factor" in listed.stdout
    refused = subprocess.run([sys.executable, "-m", "fedavg.cli", "simulate", "--strategy",
                              "fedavg", "--plugin-factor", "2"], env=env, capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == 2
    assert "strategy fedavg does not take --plugin-factor" in refused.stderr


def _lint_imports(tree: Path) -> subprocess.CompletedProcess:
    """Run ``lint-imports`` with this project's contracts on a copy of the code in ``tree``."""
    command = Path(sys.executable).parent / "lint-imports"  # the test extra installs it
    return subprocess.run([str(command)], cwd=tree, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(tree)})


def test_an_upward_import_breaks_the_layer_contract(tmp_path):
    """The contracts hold for the code as it is, and fail on a copy that imports upward."""
    for name in ("fedavg", "strategies"):
        shutil.copytree(ROOT / name, tmp_path / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    kept = _lint_imports(tmp_path)
    assert kept.returncode == 0, kept.stdout[-2000:]
    errors = tmp_path / "fedavg" / "util" / "errors.py"
    errors.write_text(errors.read_text() + "\nimport fedavg.cli.app  # noqa: E402,F401\n")
    broken = _lint_imports(tmp_path)
    assert broken.returncode == 1
    assert "fedavg.util is not allowed to import fedavg.cli" in broken.stdout
    assert "fedavg.util.errors -> fedavg.cli.app" in broken.stdout
