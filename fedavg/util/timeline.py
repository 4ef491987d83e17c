"""Where a run's start-up time goes: ``time.monotonic()`` marks, as seconds per phase.

``fedavg simulate`` marks its steps in :attr:`fedavg.run.lifecycle.RunState.marks` and writes the
phases to ``summary.json`` (``startup_s``), so a slow first round can be explained without a
profiler: imports, settings and data (``prepare``), the node data file, the ServerApp and
Flower's engine imports while Ray starts in a thread (``node_data``, see
:mod:`fedavg.engines.simulation.ray_start`), what is left of Ray's start and of creating the node
actors
(``ray_start``), Flower's engine up to the first round (``engine_start``), the first round
itself (which also waits for the node actors' imports) and the stop (Ray stopped).
"""

from __future__ import annotations

#: The phases, each from the mark before it (``imported``: fedavg's first import, see
#: :data:`fedavg.IMPORTED_AT`; a process's own start can be much earlier, e.g. that of a
#: shell that ran other commands before it ran ``fedavg``).
PHASES = (("imports", "imported", "entered"), ("prepare", "entered", "prepared"),
          ("node_data", "prepared", "node_data"), ("ray_start", "node_data", "ray"),
          ("engine_start", "ray", "round1_start"), ("round1", "round1_start", "round1_end"),
          ("stop", "last_round_end", "stopped"))


def phases(marks: dict[str, float]) -> dict[str, float]:
    """Return the seconds of each phase of :data:`PHASES` whose two marks are known.

    ``round1`` is the first round this process ran (after a resume, not round 1); ``marks``
    holds ``time.monotonic()`` per mark name.
    """
    return {name: round(marks[b] - marks[a], 3) for name, a, b in PHASES
            if a in marks and b in marks}
