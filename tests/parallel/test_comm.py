"""pcpflow.parallel.comm: every collective counts its calls and the bytes each rank receives from
the others (pcpflow/parallel/comm.py's formulas, worked by hand), a group of one moves nothing, and
draft traffic is accounted apart."""

from __future__ import annotations

import pytest
import torch

from pcpflow.parallel import comm as comm_module
from pcpflow.parallel.comm import Comm, CommStats
from pcpflow.speculative.comm import draft_comm


@pytest.fixture
def fake_group(monkeypatch):
    """Rank 1 of a group of 3, with torch.distributed's calls replaced by local ones that
    produce what the real ones would if every rank held the same tensor."""

    def all_gather(out, t, group=None):
        out.copy_(torch.cat([t] * 3))

    monkeypatch.setattr(comm_module, "_all_gather_single", all_gather)
    monkeypatch.setattr(comm_module.dist, "all_to_all_single", lambda out, t, group=None: out.copy_(t))
    monkeypatch.setattr(comm_module.dist, "broadcast", lambda t, src, group=None: t)
    monkeypatch.setattr(comm_module.dist, "all_reduce", lambda t, op=None, group=None: t.mul_(3))
    monkeypatch.setattr(comm_module.dist, "get_global_rank", lambda group, r: r)
    stats = CommStats()
    return Comm(object(), 1, 3, stats), stats


def test_bytes_each_rank_receives_by_hand(fake_group):
    comm, stats = fake_group
    t = torch.zeros((4, 2), dtype=torch.float64)  # 64 bytes
    assert comm.all_gather(t, "kv_gather").shape == (12, 2)
    comm.all_gather(t, "kv_gather")
    comm.all_to_all(torch.zeros((3, 2), dtype=torch.float32), "dcp_partials")  # 24 bytes
    comm.broadcast(torch.zeros(5, dtype=torch.int64), 0, "verify")  # 40 bytes
    comm.all_reduce(torch.ones(2, dtype=torch.float32), "verify")  # 8 bytes
    calls, nbytes = stats.end_step()
    assert calls == {"kv_gather": 2, "dcp_partials": 1, "verify": 2}
    # all_gather: size*(size-1)*n; all_to_all, broadcast: (size-1)*n; all_reduce: 2*(size-1)*n
    assert nbytes == {"kv_gather": 2 * 3 * 2 * 64, "dcp_partials": 2 * 24, "verify": 2 * 40 + 2 * 2 * 8}
    assert stats.end_step() == ({}, {})  # a new step starts empty; the run keeps the totals
    assert stats.total_bytes["kv_gather"] == 768 and stats.total_calls["verify"] == 2


def test_draft_traffic_is_accounted_apart(fake_group):
    comm, stats = fake_group
    draft_comm(comm).all_gather(torch.zeros(2, dtype=torch.float32), "kv_gather")
    assert stats.end_step() == ({"draft_kv_gather": 1}, {"draft_kv_gather": 3 * 2 * 8})


def test_a_group_of_one_is_the_identity_and_moves_nothing():
    stats = CommStats()
    solo = Comm.solo(stats)
    t = torch.arange(6.0)
    assert solo.all_gather(t, "kv_gather") is t and solo.all_to_all(t, "x") is t
    assert stats.end_step() == ({}, {})
    with pytest.raises(ValueError, match="a Comm of size 2 needs a process group"):
        Comm(None, 0, 2)
