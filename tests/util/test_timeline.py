"""Start-up phases from monotonic marks (hand-computed)."""

import time

import fedavg
from fedavg.util.timeline import phases


def test_phases_are_differences_of_consecutive_marks_and_missing_ones_are_left_out():
    marks = {"imported": 10.0, "entered": 11.5, "prepared": 13.0, "node_data": 13.25,
             "ray": 16.0, "round1_start": 17.0, "round1_end": 21.0, "last_round_end": 30.0,
             "stopped": 30.5}
    assert phases(marks) == {"imports": 1.5, "prepare": 1.5, "node_data": 0.25,
                             "ray_start": 2.75, "engine_start": 1.0, "round1": 4.0,
                             "stop": 0.5}
    del marks["imported"], marks["stopped"]
    assert set(phases(marks)) == {"prepare", "node_data", "ray_start", "engine_start",
                                  "round1"}


def test_the_imports_phase_starts_at_fedavgs_first_import_not_at_the_process_start():
    assert fedavg.IMPORTED_AT <= time.monotonic()
    assert fedavg.IMPORTED_AT > time.monotonic() - 24 * 3600  # the import, not the machine
