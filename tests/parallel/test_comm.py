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


def test_a_ring_hop_counts_what_this_rank_sends_and_skips_empty_tensors(monkeypatch):
    """Rank 1 of a ring of 3: it sends to rank 2 and receives from rank 0; an empty tensor
    is neither sent nor received (both sides know the sizes), and the bytes are this rank's
    own (point-to-point purposes are per rank, not the group's collective figure)."""
    posted = []

    class Op:
        def __init__(self, op, t, peer, group, tag=0):
            posted.append((op.__name__, tuple(t.shape), peer, tag))

    class Work:
        def wait(self):
            pass

    monkeypatch.setattr(comm_module.dist, "P2POp", Op)
    monkeypatch.setattr(comm_module.dist, "batch_isend_irecv", lambda ops: [Work() for _ in ops])
    monkeypatch.setattr(comm_module.dist, "get_global_rank", lambda group, r: 10 + r)
    stats = CommStats()
    comm = Comm(object(), 1, 3, stats)
    kv, q = torch.zeros((5, 4), dtype=torch.float64), torch.zeros((0, 2, 3), dtype=torch.float64)
    bufs = [torch.empty((2, 4), dtype=torch.float64), torch.empty((0, 2, 3), dtype=torch.float64)]
    assert comm.ring_exchange([(kv, "ring_send_kv"), (q, "ring_send_q")], bufs).wait() == bufs
    assert posted == [("isend", (5, 4), 12, 0), ("irecv", (2, 4), 10, 0)]
    assert stats.take_sent() == {"ring_send_kv": (1, 5 * 4 * 8)}
    assert stats.take_sent() == {} and stats.end_step() == ({}, {})


def test_an_uneven_all_to_all_counts_the_rows_sent_to_others(fake_group, monkeypatch):
    comm, stats = fake_group
    monkeypatch.setattr(comm_module.dist, "all_to_all_single", lambda out, t, recv, send, group=None: out.copy_(t))
    # rank 1 of 3 sends 2 rows to rank 0, 1 to itself, 3 to rank 2; a row is 4 float32
    comm.all_to_all_v(torch.zeros((6, 4), dtype=torch.float32), [2, 1, 3], [2, 1, 3], "ring_all2all")
    assert stats.take_sent() == {"ring_all2all": (1, (2 + 3) * 16)}
    comm.all_to_all_v(torch.zeros((6, 4), dtype=torch.float32), [2, 1, 3], [2, 1, 3], "moe_dispatch", nbytes=7)
    assert stats.end_step() == ({"moe_dispatch": 1}, {"moe_dispatch": 7})
