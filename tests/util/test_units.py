"""Byte counts as people read them (util/units.py)."""

from fedavg.util.units import size


def test_sizes_in_decimal_units_with_three_figures():
    assert size(812) == "812 B"
    assert size(45_300) == "45.3 kB"
    assert size(7_384_104) == "7.38 MB"
    assert size(90_800_000) == "90.8 MB"
    assert size(1_200_000_000) == "1.20 GB"
