"""The SuperLink's and SuperNode's entry points, and the patches a SuperNode runs with.

The SuperNode polls the SuperLink every 3 s and waits 0.5 s for a ClientApp's reply (both
fixed in code), sends heartbeats every 30 s, retries a connection up to 20 s apart, and
Flower's object pulls first retry after 1 s:
:func:`patch_supernode` and :func:`patch_pull_backoff` shorten these in this process.
"""

from __future__ import annotations

import contextlib
import time

from fedavg.flower_compat.checks import check_flower_internals

#: What the SuperNode's loop sleeps (seconds) when patched by :func:`patch_supernode`.
IDLE_POLL_S = 0.2
REPLY_WAIT_S = 0.02
#: First retry (seconds) of Flower's object pulls, instead of 1 s, and the longest wait
#: between two retries, instead of 10 s (an object not yet there is asked for again within
#: 0.2 s of its arrival, instead of within up to 10 s).
PULL_BACKOFF_S = 0.05
PULL_BACKOFF_CAP_S = 0.2
#: Longest wait (s) between a SuperNode's connection attempts, instead of Flower's 20: a
#: node started before its coordinator (a compose stack) joins within this long of it.
CONNECT_RETRY_CAP_S = 4
#: Seconds between a SuperNode's heartbeats (Flower: 30). The SuperLink counts a node as
#: gone after two missed beats, so a crashed machine leaves its round within ~20 s.
HEARTBEAT_S = 10


def run_superlink() -> None:
    """Run ``flower-superlink`` with the arguments in ``sys.argv``."""
    from flwr.superlink.cli import flower_superlink

    flower_superlink()


def run_supernode() -> None:
    """Run ``flower-supernode`` (``sys.argv``), patched by :func:`patch_supernode`."""
    patch_supernode()
    patch_pull_backoff()
    from flwr.supernode.cli import flower_supernode

    flower_supernode()


class _FastTime:
    """Stand-in for the ``time`` module inside the SuperNode loop: shorter fixed sleeps."""

    def __init__(self, real) -> None:
        self._real = real

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def sleep(self, seconds: float) -> None:
        if seconds == 3:  # idle poll of the SuperLink
            seconds = IDLE_POLL_S
        elif seconds == 0.5:  # wait for the ClientApp's reply
            seconds = REPLY_WAIT_S
        self._real.sleep(seconds)


def patch_supernode() -> None:
    """Shorten this (SuperNode) process's fixed idle poll (3 s) and reply wait (0.5 s).

    Heartbeats are also sent every :data:`HEARTBEAT_S` seconds, and connection attempts
    retried at most :data:`CONNECT_RETRY_CAP_S` seconds apart.
    """
    from flwr.supercore import heartbeat
    from flwr.supercore.retry import http_retry
    from flwr.supernode import fleet_http_connection as fhc
    from flwr.supernode import start_client_internal as sci

    check_flower_internals()
    if not isinstance(sci.time, _FastTime):
        sci.time = _FastTime(time)
    fhc.HEARTBEAT_DEFAULT_INTERVAL = HEARTBEAT_S  # announced to the SuperLink
    heartbeat.HEARTBEAT_DEFAULT_INTERVAL = HEARTBEAT_S  # and kept by the sender
    http_retry.MAX_RETRY_DELAY = CONNECT_RETRY_CAP_S  # read by each new retry invoker


def patch_pull_backoff() -> None:
    """Retry Flower's object pulls after :data:`PULL_BACKOFF_S`, at most every 0.2 s.

    Flower retries an object that is not there yet after 1 s, then 2, 4 and up to 10 s, at
    most 500 times. Here the waits go from :data:`PULL_BACKOFF_S` to
    :data:`PULL_BACKOFF_CAP_S`, with no cap on the tries: the pull's own time limit (Flower's
    ``max_time``, 2 hours) still ends a wait for an object that never comes.
    """
    from flwr.supercore.inflatable import inflatable_utils as iu

    wanted = {"initial_backoff": PULL_BACKOFF_S, "backoff_cap": PULL_BACKOFF_CAP_S,
              "max_tries_per_object": None}
    for fn in (iu.pull_objects, iu.pull_and_inflate_object_from_tree):
        names = list(fn.__code__.co_varnames[: fn.__code__.co_argcount])
        defaults = list(fn.__defaults__ or ())
        first = len(names) - len(defaults)
        for name, value in wanted.items():
            if name in names[first:]:
                defaults[names.index(name) - first] = value
            elif fn.__kwdefaults__ and name in fn.__kwdefaults__:
                fn.__kwdefaults__ = {**fn.__kwdefaults__, name: value}
        fn.__defaults__ = tuple(defaults) if defaults else fn.__defaults__


@contextlib.contextmanager
def seeded_simulation_ids(seed: int):
    """Within the block, the simulation engine's node (and run) ids follow from ``seed``.

    Flower draws them from ``os.urandom``, and samples a round's nodes with
    ``random.sample`` over the set of node ids: with random ids, the same seed picks
    other partitions in every run, so a run with ``--fraction < 1`` could not be repeated
    or resumed. The engine creates its nodes one after another, in partition order, so a
    seeded generator gives every partition the same id in every run.
    """
    import random

    from flwr.server.superlink.linkstate import in_memory_linkstate as state

    check_flower_internals()
    rng = random.Random(seed)
    original = state.generate_rand_int_from_bytes

    def generate(num_bytes: int, exclude: set[int] | None = None) -> int:
        num = rng.getrandbits(8 * num_bytes)
        while exclude and num in exclude:
            num = rng.getrandbits(8 * num_bytes)
        return num

    state.generate_rand_int_from_bytes = generate
    try:
        yield
    finally:
        state.generate_rand_int_from_bytes = original
