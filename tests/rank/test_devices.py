"""Where a rank's threads run (``cpu_bind``): each rank of a node on cores of its own."""

from __future__ import annotations

import os

import pytest

from pcpflow.rank import devices
from pcpflow.rank.devices import rank_cores, rank_threads


@pytest.mark.parametrize("rank,ranks,threads,cores", [
    (0, 2, 1, {10}), (1, 2, 1, {11}), (1, 2, 2, {12, 13}), (3, 4, 1, {13}), (2, 3, 2, None), (0, 5, 1, None),
])
def test_the_r_th_rank_of_a_node_takes_the_r_th_group_of_cores(monkeypatch, rank, ranks, threads, cores):
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    monkeypatch.setattr(devices.os, "sched_getaffinity", lambda pid: {13, 11, 10, 12})  # this job's 4 cores
    assert rank_cores(threads) == cores  # None: the node's ranks do not fit, the OS places them


def test_rank_threads_binds_this_thread_and_gives_it_back(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    before = os.sched_getaffinity(0)
    with rank_threads(1, "cores") as cores:  # one rank alone (no group): the first core
        assert os.sched_getaffinity(0) == cores == {min(before)}
    assert os.sched_getaffinity(0) == before
    with rank_threads(1, "none") as cores:
        assert os.sched_getaffinity(0) == before and cores is None
