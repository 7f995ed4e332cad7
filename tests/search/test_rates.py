"""Goodput's rate search on attainment curves worked by hand (no simulator)."""

from __future__ import annotations

import math

import pytest

from pcpflow.search.rates import max_rate


def _step(capacity: float):
    """Every request meets its SLOs up to ``capacity`` requests/s, none above."""
    calls = []

    def attain(rate: float) -> float:
        calls.append(rate)
        return 1.0 if rate <= capacity else 0.0

    return attain, calls


@pytest.mark.parametrize("capacity", [0.3, 1.0, 3.99])
@pytest.mark.parametrize("start", [None, "near", "far"])
def test_the_rate_found_keeps_the_attainment_and_is_within_tolerance_of_the_capacity(capacity, start):
    attain, calls = _step(capacity)
    guess = {None: None, "near": capacity * 1.02, "far": capacity * 5}[start]
    found = max_rate(attain, burst_attainment=0.0, burst_rate=4.0, target=0.9, tolerance=0.05, start=guess,
                     step=2.0 if guess is None else 1.1)
    assert found.bound == "bisected"
    assert found.rate <= capacity < found.rate * 1.05
    assert found.tried[0] == (math.inf, 0.0) and len(found.tried) == 1 + len(calls)
    assert len(calls) <= 16


@pytest.mark.parametrize("start", [None, 2.0, 40.0])
def test_no_rate_above_the_bursts_served_rate_is_tried_and_keeping_it_there_makes_it_the_goodput(start):
    """Attainment that does not fall with the rate (a compressed trace: the burst misses, 16x
    its served rate would keep it): the layout serves at most 4 requests/s, so the goodput is
    4, found without trying a rate above it."""
    calls = []

    def attain(rate: float) -> float:
        calls.append(rate)
        return 1.0

    found = max_rate(attain, burst_attainment=0.5, burst_rate=4.0, target=0.9, tolerance=0.05, start=start,
                     step=2.0 if start is None else 1.1)
    assert (found.rate, found.bound) == (4.0, "served")
    assert max(calls) == 4.0


def test_a_burst_that_keeps_the_attainment_is_the_goodput_and_nothing_else_runs():
    attain, calls = _step(1.0)
    found = max_rate(attain, burst_attainment=0.95, burst_rate=2.5, target=0.9, tolerance=0.05)
    assert (found.rate, found.bound, calls) == (2.5, "burst", [])


def test_a_layout_that_misses_even_at_the_lowest_rate_has_no_goodput():
    attain, calls = _step(0.001)
    found = max_rate(attain, burst_attainment=0.0, burst_rate=4.0, target=0.9, tolerance=0.05, lowest=1 / 16)
    assert (found.rate, found.bound) == (0.0, "below")
    assert min(calls) == pytest.approx(4.0 / 16)  # the lowest rate it tried is the floor itself


def test_attainment_at_exactly_the_target_counts_as_kept():
    found = max_rate(lambda r: 0.9 if r <= 2 else 0.5, burst_attainment=0.5, burst_rate=4.0, target=0.9,
                     tolerance=0.01)
    assert 2 / 1.01 <= found.rate <= 2


@pytest.mark.parametrize("capacity", [0.3, 1.0, 3.99])
def test_floor_first_finds_the_same_rate_and_settles_a_layout_that_never_keeps_it_in_two_runs(capacity):
    """Once the first guess (the burst's rate, 4) misses, the floor (4/16 = 0.25) is tried next."""
    attain, calls = _step(capacity)
    found = max_rate(attain, burst_attainment=0.0, burst_rate=4.0, target=0.9, tolerance=0.05, lowest=1 / 16,
                     floor_first=True)
    assert found.bound == "bisected" and found.rate <= capacity < found.rate * 1.05
    assert calls[:2] == [4.0, 0.25] and all(0.25 < r < 4.0 for r in calls[2:])

    attain, calls = _step(0.2)
    found = max_rate(attain, burst_attainment=0.0, burst_rate=4.0, target=0.9, tolerance=0.05, lowest=1 / 16,
                     floor_first=True)
    assert (found.rate, found.bound, calls) == (0.0, "below", [4.0, 0.25])
