"""The price of a handover (``disagg=pd``): one request's KV entries, prefill ranks to decode
ranks, on the links between them.

Ranks are placed as the executed world numbers them: the prefill pool's ``0 .. Wp-1``, then
the decode pool's, ``gpus_per_node`` to a node. A route between ranks on different nodes
goes through their NICs, one on the same node over NVLink, each at NCCL's point-to-point
rate (``pcpflow.simulate.collectives.p2p_rate_gbps``: to network peers the channels NCCL
opens per peer, at most the NIC; the share a transfer reaches, ``simulate.p2p_efficiency``,
fitted on Meta's ring SendRecv). Every route of a request runs at once; a rank's NIC and its
NVLink carry its routes' bytes side by side, and every message pays the link's per-hop
latency (``p2p_latency_us``) in turn. The request's transfer lasts as long as its busiest
rank.

Overlap (``disagg.transfer``): ``after_prefill`` moves the entries once the prefill is done:
all of it is exposed. ``layerwise`` sends each layer as the request's last prefill step
writes it, so that ``(L-1)/L`` of the step can hide the transfer (the last layer's part
cannot hide): exposed ``t - min(t, prefill step) x (L-1)/L``. That needs the decode pool's
blocks as the prefill runs; a request the decode pool could not take at once waited in the
prefill pool's blocks and moves whole, exposed, as ``after_prefill``'s.
"""

from __future__ import annotations

import numpy as np

from pcpflow.config.hardware import HardwareConfig, SimulateConfig
from pcpflow.layouts.transfer import MovedKV
from pcpflow.simulate.collectives import Comm, p2p_latency_us, p2p_rate_gbps

_NET, _ONE_NODE = Comm(2, 2, 1), Comm(2, 1, 2)


def transfer_seconds(moved: list[MovedKV], num_tokens: int, *, offset: int, hw: HardwareConfig, sim: SimulateConfig,
                     layerwise: bool) -> float:
    """How long one request's routes take, every cache of ``moved`` (the target's, a
    drafter's) at once (prefill rank ``src`` is global rank ``src``, decode rank ``dst``
    global rank ``offset + dst``): its busiest rank's bytes and messages."""
    sizes = [m.sizes(num_tokens) for m in moved]
    if not sum(len(r) for r in sizes):
        return 0.0
    gpn = hw.gpus_per_node
    src = np.concatenate([r.src for r in sizes])
    dst = np.concatenate([r.dst for r in sizes]) + offset
    nbytes = np.concatenate([r.entries * float(m.group_bytes * m.num_layers) for r, m in zip(sizes, moved)])
    messages = np.concatenate([np.full(len(r), m.num_layers if layerwise else 1) for r, m in zip(sizes, moved)])
    network = src // gpn != dst // gpn
    # each route loads both of its ends: (rank, over the network) -> bytes, messages, peers
    rank, peer = np.concatenate([src, dst]), np.concatenate([dst, src])
    keys, at = np.unique(rank * 2 + np.concatenate([network, network]), return_inverse=True)
    load = np.bincount(at, weights=np.concatenate([nbytes, nbytes]))
    msgs = np.bincount(at, weights=np.concatenate([messages, messages]))
    width = int(peer.max()) + 1
    peers = np.bincount(np.unique(at * width + peer) // width, minlength=len(keys))
    worst = 0.0
    for net, n in set(zip((keys % 2).tolist(), peers.tolist())):
        rate, latency_s = _route(hw, sim, bool(net), n)
        these = (keys % 2 == net) & (peers == n)
        t = msgs[these] * latency_s + load[these] / (rate * 1e9)
        worst = max(worst, float(t.max()))
    return worst


def _route(hw: HardwareConfig, sim: SimulateConfig, network: bool, peers: int) -> tuple[float, float]:
    """(GB/s, seconds a message) of a rank's routes to ``peers`` peers: NCCL's point-to-point
    rate and per-hop latency; on a measured profile without NCCL's graphs (a CPU's), its
    send/recv table's fitted bandwidth and latency, the peers sharing the rank's one thread."""
    if not hw.nccl:
        from pcpflow.simulate.measured import MeasuredCollectives

        table = MeasuredCollectives(hw.tables)
        ranks = table.smallest("sendrecv")
        assert ranks is not None, "a measured profile times send/recv on every group (pcpflow.profile.sections)"
        return table.rate_gbps("sendrecv", ranks), table.latency_s("sendrecv", ranks)
    rate = p2p_rate_gbps(hw, _NET if network else _ONE_NODE, network=network, efficiency=sim.p2p_efficiency, peers=peers)
    return rate, p2p_latency_us(hw, network=network) * 1e-6


def exposed_seconds(seconds: float, *, layerwise: bool, num_layers: int, prefill_step_s: float, waited: bool) -> float:
    """What a request waits for its transfer after its prefill ends (see the module's overlap)."""
    if not layerwise or waited:
        return seconds
    return seconds - min(seconds, prefill_step_s) * (num_layers - 1) / num_layers
