"""Every shell block of Getting started and of the README's tour runs as written, on digits.

The lines are run in a fresh folder by bash, one script per page, with ``set -e``: a command
that stops working fails the test. Left out are the install lines (``python3 -m venv``,
``pip install``: CI has just installed the project the same way) and the tour's Docker line
(the container test, ``tests/engines/test_containers.py``, runs the compose stack). The tour's
coordinator port is a free one instead of 9092, so parallel tests do not collide.
"""

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from helpers.cli import ROOT, engine_processes
from helpers.patience import within

from fedavg.engines.deployment.processes import free_port

pytestmark = pytest.mark.e2e

SKIPPED = ("python3 -m venv", "pip install", "docker ")


def shell_lines(markdown: str) -> list[str]:
    """Return the commands of a page's ```bash blocks, in order, without the install lines."""
    blocks = re.findall(r"^```bash\n(.*?)^```", markdown, re.M | re.S)
    lines = [line for block in blocks for line in block.splitlines() if line.strip()]
    return [line for line in lines if not line.startswith(SKIPPED)]


def readme_tour() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split("## A tour", 1)[1].split("\n## ", 1)[0]


def run_script(lines: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    script = "set -euo pipefail\n" + "\n".join(lines) + "\n"
    proc = subprocess.Popen(["bash", "-c", script], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "COLUMNS": "120"})
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        raise AssertionError(f"the page's commands ran past {timeout:.0f} s:\n{out[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{out[-6000:]}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out)


def test_the_tour_finds_its_commands():
    tour = shell_lines(readme_tour())
    assert 10 <= len(tour) <= 15
    commands = set(re.findall(r"\bfedavg (\w+)", "\n".join(tour)))
    assert {"simulate", "evaluate", "predict", "sweep", "report", "merge", "certs",
            "coordinator", "node"} <= commands
    assert any(line.startswith("docker ") for line in
               readme_tour().split("```bash", 1)[1].split("```", 1)[0].splitlines())
    assert "pip install" not in " ".join(tour)


def test_getting_started_runs_as_written(tmp_path):
    lines = shell_lines((ROOT / "docs" / "getting-started.md").read_text())
    assert len(lines) >= 5
    out = run_script(lines, tmp_path, timeout=within(300)).stdout
    assert (tmp_path / "runs" / "first" / "summary.json").is_file()
    assert '"accuracy"' in out  # evaluate --json
    assert (tmp_path / "digit.png").is_file()
    rows = (tmp_path / "predictions.csv").read_text().splitlines()
    assert rows[0] == "input,prediction,class_index,confidence" and len(rows) > 300
    assert not engine_processes()


def test_the_readme_tour_runs_as_written(tmp_path):
    configs = tmp_path / "experiments" / "configs"
    configs.mkdir(parents=True)
    shutil.copy(ROOT / "experiments" / "configs" / "tiny.toml", configs)
    port = str(free_port())
    lines = [line.replace("localhost:9092", f"localhost:{port}")
             .replace("--min-nodes 2", f"--min-nodes 2 --address 127.0.0.1:{port}")
             for line in shell_lines(readme_tour())]
    run_script(lines, tmp_path, timeout=within(600))
    runs = tmp_path / "runs"
    for run in ("demo", "skewed", "one-shot", "ties", "deployed"):
        assert (runs / run / "summary.json").is_file(), run
    assert (runs / "tiny" / "results.md").is_file()
    assert (tmp_path / "predictions.csv").stat().st_size > 0
    assert not engine_processes()
