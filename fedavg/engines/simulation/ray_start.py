"""Starting a simulation's Ray instance and its node actors while the driver sets up the run.

A node actor is ready to train only after Ray's start (about 4-5 s: its GCS, raylet and
agents) and its own imports (Ray, Flower's simulation engine, torch and ``torch._dynamo``,
which every optimizer step imports: about 4.5 s of one core). :class:`RayStart` does both in
a thread while the driver writes the node data, builds the ServerApp and imports Flower's
engine (:func:`fedavg.flower_compat.node_actors`); Flower's actor pool then takes these actors
(:func:`~fedavg.flower_compat.prestarted_actors`) instead of creating its own as the first
round begins. The run's settings and data are checked before it starts, so a bad input never
waits for Ray.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

from fedavg.flower_compat import disable_ray_auto_connect, node_actors, ray_on_loopback
from fedavg.util.errors import UserError, first_line

#: The longest the driver waits for a Ray start it no longer needs (an error, Ctrl-C) before
#: it stops whatever Ray processes there are.
SETTLE_WAIT_S = 30.0


def init_ray(backend: dict[str, Any], temp_dir: str) -> None:
    """Start Ray (or join ``--ray-address``'s cluster) as Flower's Ray backend would.

    Flower's backend reuses an initialised Ray. Called from :class:`RayStart`'s thread,
    ``ray.init`` installs no signal handler of its own (it does so only in the main thread),
    so the application's SIGINT / SIGTERM handlers (the CLI's clean shutdown) stay in force.
    A Ray instance of the run's own inherits this process's environment, ``PYTHONPATH``
    included (:func:`export_python_path`), so its workers start without a runtime
    environment, which would cost each node process about a second; a cluster's workers get
    ``PYTHONPATH`` as one. A run's own Ray listens on 127.0.0.1 only (:func:`ray_on_loopback`).

    Raises
    ------
    UserError
        The ``--ray-address`` cluster cannot be joined.
    """
    import ray

    # Flower's engine threads still call Ray while the run ends; with auto-connect on, such a
    # call after shutdown starts a fresh Ray instance that outlives the command.
    disable_ray_auto_connect()
    if ray.is_initialized():
        return
    cluster = "address" in backend["init_args"]
    # A Ray folder of this run's own: its processes can be told from another run's.
    own = ({"runtime_env": {"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}}} if cluster
           else {"_temp_dir": temp_dir})
    try:
        if cluster:
            ray.init(**own, **backend["init_args"])
        else:  # nothing outside this machine needs to reach a run's own Ray
            with ray_on_loopback():
                ray.init(**own, **backend["init_args"])
    except (ConnectionError, RuntimeError, ValueError) as exc:
        if not cluster:
            raise
        raise UserError(f"cannot use the Ray cluster at {backend['init_args']['address']}: "
                        f"{first_line(exc)} (start it with `ray start --head`; every machine "
                        "needs the same Ray, flwr and fedavg versions)") from None


def export_python_path(backend: dict[str, Any]) -> None:
    """Put this process's ``sys.path`` into ``PYTHONPATH``, as Flower's Ray backend does.

    Node processes then import what the driver can (a user's model file's folder, a source
    checkout). A private Ray instance must not join another cluster through ``RAY_ADDRESS``.
    """
    pythonpath = os.pathsep.join(sys.path)
    if os.environ.get("PYTHONPATH"):
        pythonpath = f"{pythonpath}{os.pathsep}{os.environ['PYTHONPATH']}"
    os.environ["PYTHONPATH"] = pythonpath
    if "address" not in backend["init_args"]:
        os.environ.pop("RAY_ADDRESS", None)


class RayStart:
    """Ray's start and the node actors' creation, in a thread of their own.

    The thread lives until :meth:`release`: Ray starts its GCS and raylet with a parent-death
    signal, which Linux sends when the *thread* that started them ends.

    Parameters
    ----------
    backend : dict
        Flower's Ray backend config (``init_args``, ``client_resources``).
    temp_dir : str
        Ray's folder for a private instance.
    """

    def __init__(self, backend: dict[str, Any], temp_dir: str) -> None:
        self.backend, self.temp_dir = backend, temp_dir
        self.actors: list = []
        self._error: BaseException | None = None
        self._ready, self._released = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._start, name="fedavg-ray-start",
                                        daemon=True)

    def start(self) -> RayStart:
        """Begin starting Ray; return at once."""
        export_python_path(self.backend)
        self._thread.start()
        return self

    def _start(self) -> None:
        try:
            init_ray(self.backend, self.temp_dir)
            # lazy: loads cryptography, flwr, torch, which only this path needs
            from fedavg.node.clientapp import warm_up

            self.actors = node_actors(self.backend["client_resources"], warm_up)
        except BaseException as exc:  # noqa: BLE001 - raised in the driver's thread by wait()
            self._error = exc
        finally:
            self._ready.set()
        self._released.wait()

    def wait(self) -> list:
        """Wait until Ray is up and the actors are created; return the actors.

        Raises
        ------
        UserError
            The cluster of ``--ray-address`` cannot be joined.
        Exception
            Whatever else Ray's start raised.
        """
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self.actors

    def settle(self) -> None:
        """Let a start still under way finish, unused (at most :data:`SETTLE_WAIT_S`).

        Stopping Ray's processes while ``ray.init`` still starts them could leave one
        behind: the caller stops them after this returns, then calls :meth:`release`.
        """
        self._ready.wait(SETTLE_WAIT_S)

    def release(self) -> None:
        """End the thread (Ray stopped by then: see the class notes)."""
        self._released.set()
        self._thread.join(SETTLE_WAIT_S)
