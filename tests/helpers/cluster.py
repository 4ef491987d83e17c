"""A localhost cluster: ``fedavg coordinator`` and ``fedavg node`` started, watched, stopped."""

import json
import os
import re
import subprocess
import sys
import time
import uuid

from fedavg.engines.deployment.processes import free_port
from helpers.cli import tagged_processes
from helpers.patience import within


def cluster_processes(tag: str) -> list[str]:
    """Live processes started under this test's tag (env FEDAVG_TEST_TAG), children too."""
    return tagged_processes("FEDAVG_TEST_TAG", tag)


class Cluster:
    """Start `fedavg` commands in the background; kill and check them at the end."""

    def __init__(self, tmp_path):
        self.tmp = tmp_path
        self.tag = uuid.uuid4().hex
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, *args) -> subprocess.Popen:
        """Start `fedavg ARGS` in the background, its output in NAME.log."""
        log = open(self.tmp / f"{name}.log", "w")
        env = {**os.environ, "COLUMNS": "200", "FEDAVG_TEST_TAG": self.tag,
               "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen([sys.executable, "-m", "fedavg.cli", *map(str, args)],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
        proc.name = name
        self.procs.append(proc)
        return proc

    def coordinator(self, *args):
        """Start `fedavg coordinator` on this cluster's address."""
        return self.start("coordinator", "coordinator", "--address", self.address, *args)

    def node(self, name, *args):
        """Start `fedavg node` against this cluster's coordinator."""
        return self.start(name, "node", "--coordinator", self.address, *args)

    def log(self, name: str) -> str:
        """Everything the command NAME printed so far."""
        return (self.tmp / f"{name}.log").read_text()

    def wait(self, proc, timeout=240) -> int:
        """Exit code of ``proc``; fail with its log if it runs past ``timeout`` s."""
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{proc.name} still running after {timeout} s:\n"
                                 f"{self.log(proc.name)[-3000:]}") from None

    def wait_for(self, name: str, pattern: str, timeout=120) -> str:
        """Wait until the log of NAME matches ``pattern`` (a regex); return the log."""
        deadline = time.monotonic() + timeout
        while not re.search(pattern, text := self.log(name)):
            assert time.monotonic() < deadline, f"no {pattern!r} in {name}:\n{text[-3000:]}"
            time.sleep(0.2)
        return text

    def close(self):
        """Stop every command, then fail if any process of the cluster is left."""
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        deadline = time.monotonic() + within(15)
        while cluster_processes(self.tag) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = cluster_processes(self.tag)
        assert not left, f"processes left alive: {left}"
        # a node or coordinator a test killed outright (SIGKILL) left its private folder,
        # which the next one removes (its lock is free): the test is that next one
        from fedavg.util.tempdirs import remove_abandoned

        for prefix in ("fedavg-node-", "fedavg-coordinator-"):
            remove_abandoned(prefix)


def rounds_of(out):
    """Read the rounds of ``metrics.jsonl`` in run folder ``out``."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
