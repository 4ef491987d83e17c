"""Deadlines that follow the machine's speed: a test must not fail because the machine is busy.

A test that waits for something (a round finished, a process gone, a log line) waits on
the event itself and gives up only after ``within(seconds)``: ``seconds`` as measured on a
quiet 2-core machine, scaled by how much slower this machine is now (:func:`slowness`).
pytest's own per-test limit is scaled the same way (``tests/conftest.py``).
"""

import functools
import os
import time

#: Seconds the reference work (:func:`_reference_work`) takes on a 2-core machine running
#: one other CPU-bound job (measured: 0.076 s).
REFERENCE_S = 0.08


def _reference_work() -> float:
    """Time a fixed piece of CPU work (pure Python and a matrix product); seconds."""
    import numpy as np

    start = time.perf_counter()
    total = 0
    for i in range(1_500_000):
        total += i % 7
    a = np.random.default_rng(0).standard_normal((300, 300))
    for _ in range(20):
        a = np.tanh(a @ a.T / 300)
    return time.perf_counter() - start


@functools.cache
def _measured() -> float:
    _reference_work()  # warm up (imports, caches)
    return max(1.0, sorted(_reference_work() for _ in range(3))[1] / REFERENCE_S)


def slowness() -> float:
    """How many times slower than a quiet 2-core machine this one is now (>= 1).

    The larger of the reference work's time (measured once per test process) and the
    load: runnable processes per core over the last minute. ``FEDAVG_TEST_PATIENCE``
    multiplies it (e.g. 2 on a machine known to be shared).
    """
    load = os.getloadavg()[0] / (os.cpu_count() or 1)
    return max(_measured(), load, 1.0) * float(os.environ.get("FEDAVG_TEST_PATIENCE", "1"))


def within(seconds: float) -> float:
    """Return ``seconds`` (a limit on a quiet 2-core machine) scaled to this machine now."""
    return seconds * slowness()
