"""Collectives as NCCL prices and picks them, and point-to-point transfers.

NCCL is pinned at **v2.29.7-1**, the version torch 2.13 ships (its PyPI wheel requires
``nvidia-nccl-cu13==2.29.7``; commit b91894bd5b190c874d98a017f93f5daa515b65d0). Everything
in ``NcclTuner`` follows that version's ``src/graph/tuning.cc`` (``ncclTopoTuneModel``:
bandwidth and latency per collective, algorithm and protocol; ``ncclTopoGetAlgoTime``) and
``src/enqueue.cc`` (``topoGetAlgoInfo``: the fastest enabled pair; ``nBytes`` of an
all-gather or reduce-scatter is the whole output, ``ncclFuncMaxSendRecvCount``):

- algorithms Tree, Ring, CollNet Direct / Chain, NVLS, NVLS Tree, PAT; protocols LL, LL128,
  Simple; time = latency + nBytes / bandwidth, the smallest over the enabled pairs; Tree at
  0.85 where a node holds one rank of the communicator (the TREE pattern); NVLS Tree with the
  tree's correction factors on Blackwell with an x86 host;
- CollNet (and NVLS across nodes, which needs it) is off: it needs the SHARP collnet plugin
  (``collnetEnable``), which no profile here has; PAT serves all-gather / reduce-scatter
  when every rank is on its own node (``ncclPatEnable``): a CP group;
- LL128 is on (Hopper and Blackwell, NVLink inside, NICs on the GPUs' PCIe switches);
- one operation at a time (``numPipeOps = 1``: no aggregation).

The channels and per-channel bandwidths of each algorithm's graph are NCCL's topology
search's (``src/graph/search.cc``), not tuning.cc's: the hardware profile states them
(``hardware.nvlink.ring`` ...) with the derivation. A communicator spread over nodes with
``k`` ranks in a node uses ``k`` NICs there (one per GPU; ``graph_of``).

All-to-all and send/recv are point-to-point: NCCL does not tune them. A transfer to a peer
costs NCCL's per-hop Simple latency of its link plus its bytes at the peer's rate: over
NVLink ``hardware.nvlink.p2p_gbps``; to a network peer NCCL's channels per net peer
(``src/graph/paths.cc``: one per NIC, at least ``nic / P2P_PER_CHANNEL_NET_BW``, a power of
two, halved while the peers do not fit ``p2pnChannels``) times ``network.p2p_channel_gbps``,
at most the NIC. An all-to-all sends every peer its share at once, bound by the NIC for the
peers off the node and by NVLink for those on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from pcpflow.config.hardware import HardwareConfig

NCCL_VERSION = "v2.29.7-1"
FUNCS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "reduce")
ALGOS = ("tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat")
PROTOS = ("LL", "LL128", "Simple")
TREE, RING, CN_DIRECT, CN_CHAIN, NVLS, NVLS_TREE, PAT = range(7)
LL, LL128, SIMPLE = range(3)
NVLINK_HW, PCI_HW, NET_HW = range(3)

# --- tuning.cc, ncclTunerConstantsDefaults (v2.29.7-1), microseconds and GB/s
BASE_LATENCY = [
    [6.8, 14.0, 8.4], [6.6, 14.0, 8.4],  # Tree, Ring (LL, LL128, Simple)
    [0, 0, 0], [0, 0, 0],  # CollNet Direct, Chain
    [0, 0, 0], [0, 0, 0],  # NVLS, NVLS Tree
    [8.0, 8.0, 8.0],  # PAT
]
HW_LATENCY = [
    [[.6, 1.25, 4.0], [.6, 1.9, 3.4], [0, 0, 3.7], [0, 0, 2.8], [0, 0, 25], [0, 0, 25], [0, 0, 4.0]],  # NVLINK
    [[1.0, 1.9, 4.0], [1.0, 2.5, 5.7], [0, 0, 3.7], [0, 0, 2.8], [0, 0, 0], [0, 0, 0], [0, 0, 4.0]],  # PCI
    [[5.0, 8.5, 14], [2.7, 4.0, 14.0], [0, 0, 31], [0, 0, 30], [0, 0, 18], [0, 0, 20.9], [0, 0, 14]],  # NET
]
_ARCH = {"hopper": 2, "blackwell": 3}  # NCCL_HOPPER_COMPCAP_IDX, NCCL_BLACKWELL_COMPCAP_IDX
LL_MAX_BW = [[39.0, 39.0, 20.4], [87.7, 22.5, 19.0], [141.0, 45.0, 35.0], [282.0, 90.0, 70.0]]
PER_CH_MAX_RING_LL128_BW = [[20.0] * 3, [20.0] * 3, [36.7] * 3, [40.0] * 3]
PER_CH_MAX_TREE_LL128_BW = [[20.0] * 3, [20.0] * 3, [36.7, 36.7, 29.0], [55.6, 31.67, 20.0]]
PER_CH_MAX_TREE_BW = [[26.5, 18.5, 10.0], [24.0, 23.6, 17.8], [38.7, 41.4, 36.0], [70.0, 42.8, 24.0]]
PER_CH_MAX_NVLS_TREE_BW = [[26.5, 18.5, 10.0], [24.0, 23.6, 17.8], [0.0, 57.7, 45.5], [0.0, 96.0, 43.8]]
NVLS_EFFICIENCY = [0.0, 0.0, 0.85, 0.74]
TREE_CORRECTION = [  # powers of two, 64 B to 256 MB (ncclTopoGetAlgoTime)
    [1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0],
    [1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0],
    [.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9],
]
NCCL_MAX_NVLS_ARITY = 32
P2P_PER_BATCH = 8  # NCCL_MAX_DEV_WORK_P2P_PER_BATCH


def _log2i(n: int) -> int:
    return max(int(n), 1).bit_length() - 1


@dataclass(frozen=True)
class Comm:
    """A communicator as NCCL sees it: ranks, nodes, the most ranks it has in one node, and
    the fewest (None: as many as the most)."""

    nranks: int
    nnodes: int
    local_ranks: int
    min_local_ranks: int | None = None

    @property
    def tree_pattern(self) -> bool:
        """``comm->maxTreePattern == NCCL_TOPO_PATTERN_TREE``: search.cc gives a node where the
        communicator has one GPU the plain TREE pattern (``ngpus == 1``), and init.cc keeps the
        largest pattern over the nodes; with more GPUs a node's search keeps BALANCED_TREE, its
        first choice (NVIDIA/nccl#1197's H100 dump: "Pattern 1")."""
        return self.nranks > 1 and (self.min_local_ranks or self.local_ranks) == 1


@dataclass(frozen=True)
class Graphs:
    """Per algorithm: (channels, bwIntra, bwInter), or None when the search finds no graph."""

    ring: tuple[int, float, float]
    tree: tuple[int, float, float]
    nvls: tuple[int, float, float] | None


def graph_of(hw: HardwareConfig, comm: Comm) -> Graphs:
    """The graphs NCCL's search gives ``comm`` on ``hw`` (profile values; see module doc).
    Inside one node: the NVLink graphs. Across nodes, ``k`` ranks per node: the one-GPU
    network graph once per NIC (``k`` of them), its channels' bandwidth capped so that the
    node's ring stays within the NVLink ring's; NVLS Tree reaches the other nodes through
    the same NICs, spread over its channels."""
    nv = hw.nvlink
    if comm.nnodes == 1:
        as_t = lambda g: (g.channels, g.channel_gbps, g.bw_inter)  # noqa: E731
        return Graphs(as_t(nv.ring), as_t(nv.tree), as_t(nv.nvls) if nv.nvls and comm.local_ranks > 1 else None)
    k, net = comm.local_ranks, hw.network.ring
    channels = net.channels * k
    bw = min(net.channel_gbps, nv.ring.gbps / channels) if k > 1 else net.channel_gbps
    nvls = None
    if nv.nvls is not None and k > 1:
        # NOTE: search.cc's pass 2 raises an NVLS graph's bwInter above its bwIntra (up to twice
        # it) as far as the paths it checks with bwInter allow: across nodes, the heads' NICs.
        inter = min(nv.nvls.bw_inter, k * net.gbps / nv.nvls.channels)
        nvls = (nv.nvls.channels, nv.nvls.channel_gbps, inter)
    return Graphs((channels, bw, bw), (channels, bw, bw), nvls)


class NcclTuner:
    """``ncclTopoTuneModel`` for one communicator: ``bandwidth[f][a][p]`` (GB/s of algorithm
    bandwidth, 0 when disabled) and ``latency[f][a][p]`` (us); ``pick(func, nbytes)``."""

    def __init__(self, hw: HardwareConfig, comm: Comm) -> None:
        self.comm = comm
        # NOTE: minCompCap >= 100 on an x86 host: NVLS Tree takes the tree's correction factors too
        self.blackwell_x86 = hw.arch == "blackwell" and hw.cpu in ("intel", "amd")
        n, nodes = comm.nranks, comm.nnodes
        self.bandwidth = [[[0.0] * 3 for _ in ALGOS] for _ in FUNCS]
        self.latency = [[[0.0] * 3 for _ in ALGOS] for _ in FUNCS]
        if n <= 1:
            return
        g = graph_of(hw, comm)
        graphs = {RING: g.ring, TREE: g.tree, PAT: g.ring, NVLS: g.nvls, NVLS_TREE: g.nvls}
        cc = _ARCH[hw.arch]
        index2 = nodes - 1 if nodes <= 2 else 2
        index1 = cc if nodes == 1 else (1 if hw.cpu == "amd" else 0)
        ll_max = LL_MAX_BW[index1][index2]
        tree_max, ring_ll128_max = PER_CH_MAX_TREE_BW[cc][index2], PER_CH_MAX_RING_LL128_BW[cc][index2]
        tree_ll128_max, nvls_tree_max = PER_CH_MAX_TREE_LL128_BW[cc][index2], PER_CH_MAX_NVLS_TREE_BW[cc][index2]
        ppn = n / nodes
        pat_ok = nodes == n  # ncclPatEnable: one GPU per node
        intra_hw = NVLINK_HW  # typeIntra == LINK_NVL (NVSwitch systems)
        hw_of = NVLINK_HW if nodes == 1 else NET_HW
        net_overhead = 2.0 if hw.cpu == "amd" else 1.0  # getNetOverhead (x86)
        lat_inter_graph = hw.network.latency_us
        for f, func in enumerate(FUNCS):
            nsteps = 2 * (n - 1) if func == "all_reduce" else n - 1 if func in ("all_gather", "reduce_scatter") else n
            for a in range(len(ALGOS)):
                if func in ("broadcast", "reduce") and a != RING:
                    continue
                if func in ("all_gather", "reduce_scatter") and a not in (PAT, RING, NVLS, CN_DIRECT):
                    continue
                if func == "all_reduce" and a == PAT:
                    continue
                if a in (CN_DIRECT, CN_CHAIN):
                    continue  # collnetEnable == 0: no SHARP plugin
                if a == NVLS and nodes > 1:
                    continue  # NVLS across nodes needs CollNet
                if a == NVLS_TREE and nodes == 1:
                    continue
                if a in (NVLS, NVLS_TREE) and (graphs[a] is None or (func != "all_reduce" and comm.local_ranks > NCCL_MAX_NVLS_ARITY)):
                    continue
                if a == PAT and not pat_ok:
                    continue
                nch, bw_intra, bw_inter = graphs[a]
                for p in range(3):
                    if a in (NVLS, NVLS_TREE) and p != SIMPLE:
                        continue
                    if a == PAT and p != SIMPLE:
                        continue
                    bw = bw_intra if nodes <= 2 else bw_inter
                    if a in (NVLS, NVLS_TREE):
                        if nch < 2:
                            continue
                        intra = bw_intra * NVLS_EFFICIENCY[cc] * (nch - 1) / nch
                        intra *= 2.0 if func == "all_reduce" else (ppn - 1) / ppn
                        inter = bw_inter * (2 if (nodes <= 2 and a == NVLS_TREE) else 1)
                        bw = min(intra, inter, nvls_tree_max if a == NVLS_TREE else math.inf)
                    bus = nch * bw
                    if a == RING and p == LL:
                        bus = min(ll_max, bus * .5)
                    if a == RING and p == LL128:
                        bus = min(bus * 0.92, nch * ring_ll128_max)
                    if a == TREE and func == "all_reduce":
                        bus = min(bus * .92, nch * tree_max)
                    if a == TREE and p == LL:
                        bus = min(bus * 1.0 / 3.8, ll_max)
                    if a == TREE and p == LL128:
                        bus = min(bus * (7.0 / 9.0 if nodes == 1 else 120.0 / 128.0), nch * tree_ll128_max)
                    if a == TREE and comm.tree_pattern:
                        bus *= .85
                    if a == PAT:
                        bus *= .75
                    if not (a != RING and func in ("all_gather", "reduce_scatter")):
                        bus *= (n / nsteps) if a in (RING, NVLS, NVLS_TREE) else .5
                    self.bandwidth[f][a][p] = bus
                    lat = BASE_LATENCY[a][p]
                    intra_lat = HW_LATENCY[intra_hw][a][p]
                    inter_lat = (HW_LATENCY[NET_HW][TREE][p] if ppn == 1 else HW_LATENCY[NET_HW][a][p]) + lat_inter_graph
                    if p == SIMPLE:
                        inter_lat += lat_inter_graph
                    if a == RING:
                        if func in ("reduce", "broadcast"):
                            lat += HW_LATENCY[hw_of][a][p]  # sameChannels
                        else:
                            overhead = (net_overhead * (3 if p == SIMPLE else 1)) if nodes > 1 else 0.0
                            intra_lat = max(intra_lat, overhead)
                            inter_steps = 0 if nodes == 1 else 2 * (nodes - 1) if func == "all_reduce" else nodes - 1
                            lat += (nsteps - inter_steps) * intra_lat + inter_steps * inter_lat
                    elif a == TREE:
                        if func == "all_reduce":
                            lat += 2 * ((n // nodes - 1) * intra_lat + _log2i(nodes) * inter_lat)
                    elif a == NVLS:
                        lat = intra_lat + (inter_lat if nodes > 1 else 0.0)
                    elif a == NVLS_TREE:
                        lat += intra_lat + 2 * _log2i(nodes) * inter_lat
                    elif a == PAT and func in ("all_gather", "reduce_scatter"):
                        lat += _log2i(nodes) * (inter_lat / 3.5) + n * 2.8
                    self.latency[f][a][p] = lat
        # NOTE: comm->nChannels after ncclTopoPostset doubles the rings (connect.cc), for the
        # ring's plateau rule below.
        self.comm_channels = 2 * min(g.ring[0], g.tree[0])
        # NOTE: pick tries the enabled pairs alone, in NCCL's order: a disabled one (bandwidth
        # 0, time -1) is never picked.
        self.enabled = {func: [(a, p) for a in range(len(ALGOS)) for p in range(3) if self.bandwidth[f][a][p] != 0]
                        for f, func in enumerate(FUNCS)}

    def time_us(self, func: str, a: int, p: int, nbytes: float) -> float:
        """``ncclTopoGetAlgoTime``; -1 when the pair is disabled."""
        f = FUNCS.index(func)
        bw, lat = self.bandwidth[f][a][p], self.latency[f][a][p]
        if bw == 0:
            return -1.0
        log_size = _log2i(int(nbytes) >> 6) if int(nbytes) >> 6 else -1
        if a == TREE and func == "all_reduce" and 0 <= log_size < 23:
            bw *= TREE_CORRECTION[p][log_size]
        if a == NVLS_TREE and func == "all_reduce" and 0 <= log_size < 24 and self.blackwell_x86:
            bw *= TREE_CORRECTION[p][log_size]
        if (a == RING and p == SIMPLE and self.comm.nnodes > 1 and func == "all_reduce"
                and nbytes / (self.comm_channels * self.comm.nranks) >= 64):
            lat *= 1.4  # plateau effect of the ring (compute capability >= 80)
        return lat + nbytes / (1000.0 * bw)

    def pick(self, func: str, nbytes: float) -> tuple[str, str, float]:
        """(algorithm, protocol, seconds) NCCL chooses for ``nbytes`` (``topoGetAlgoInfo``)."""
        if self.comm.nranks <= 1:
            return "ring", "Simple", 0.0
        # NOTE: time_us's expressions, inlined (a prefill step's sizes are new: every pick runs)
        f = FUNCS.index(func)
        bandwidth, latency = self.bandwidth[f], self.latency[f]
        log_size = _log2i(int(nbytes) >> 6) if int(nbytes) >> 6 else -1
        reduce = func == "all_reduce"
        plateau = (reduce and self.comm.nnodes > 1
                   and nbytes / (self.comm_channels * self.comm.nranks) >= 64)
        best = (math.inf, RING, SIMPLE)
        for a, p in self.enabled[func]:
            bw, lat = bandwidth[a][p], latency[a][p]
            if a == TREE and reduce and 0 <= log_size < 23:
                bw *= TREE_CORRECTION[p][log_size]
            if a == NVLS_TREE and reduce and 0 <= log_size < 24 and self.blackwell_x86:
                bw *= TREE_CORRECTION[p][log_size]
            if a == RING and p == SIMPLE and plateau:
                lat *= 1.4
            t = lat + nbytes / (1000.0 * bw)
            if 0 <= t < best[0]:
                best = (t, a, p)
        t, a, p = best
        return ALGOS[a], PROTOS[p], t * 1e-6


@lru_cache(maxsize=256)
def tuner(hw: HardwareConfig, comm: Comm) -> NcclTuner:
    return NcclTuner(hw, comm)


# --- point to point (NCCL does not tune it)
def net_peer_channels(hw: HardwareConfig, comm: Comm) -> int:
    """NCCL's channels to one network peer (paths.cc ``ncclTopoGetNchannels`` and
    ``ncclTopoComputeP2pChannels``): one per local NIC (one per GPU), at least
    ``nic / P2P_PER_CHANNEL_NET_BW``, a power of two; halved while the peers of a round do not
    fit the communicator's p2p channels (its ring channels, doubled by ncclTopoPostset)."""
    net = hw.network
    per_peer = _pow2_up(max(1, math.ceil(int(net.nic_gbps) / int(net.p2p_channel_gbps))))
    p2p_channels = _pow2_up(2 * graph_of(hw, comm).ring[0])
    while per_peer * -(-comm.nranks // P2P_PER_BATCH) > p2p_channels and per_peer > 1:
        per_peer //= 2
    return per_peer


def p2p_rate_gbps(hw: HardwareConfig, comm: Comm, *, network: bool, efficiency: float = 1.0, peers: int = 1) -> float:
    """What a rank sends to ``peers`` peers at once: over NVLink, its rate times the share a
    transfer reaches (``simulate.p2p_efficiency``); to network peers, NCCL's channels to each
    (``net_peer_channels``), each moving that share of ``P2P_PER_CHANNEL_NET_BW``, at most the NIC."""
    if not network:
        return hw.nvlink.p2p_gbps * efficiency
    per_peer = net_peer_channels(hw, comm) * hw.network.p2p_channel_gbps * efficiency
    return min(hw.network.nic_gbps, peers * per_peer)


def p2p_latency_us(hw: HardwareConfig, *, network: bool) -> float:
    """NCCL's per-hop Simple latency of the link (tuning.cc hwLatencies, Ring / Simple),
    plus the NET plugin's own and its flush (as tuning.cc adds them to a Simple step)."""
    if network:
        return HW_LATENCY[NET_HW][RING][SIMPLE] + 2 * hw.network.latency_us
    return HW_LATENCY[NVLINK_HW][RING][SIMPLE]


def sendrecv_seconds(hw: HardwareConfig, comm: Comm, nbytes: float, *, network: bool, efficiency: float = 1.0) -> float:
    """One rank sends ``nbytes`` to one peer while receiving as much (a ring step)."""
    if nbytes <= 0:
        return 0.0
    rate = p2p_rate_gbps(hw, comm, network=network, efficiency=efficiency)
    return p2p_latency_us(hw, network=network) * 1e-6 + nbytes / (rate * 1e9)


def all_to_all_seconds(hw: HardwareConfig, comm: Comm, send_bytes: float, *, efficiency: float = 1.0) -> float:
    """A rank sends ``send_bytes`` split evenly over the ``n`` ranks (its own share stays):
    the ``(n - k) / n`` bound off the node leave through its NIC while ``(k - 1) / n`` cross
    NVLink, each peer at most at its point-to-point rate."""
    n, k = comm.nranks, comm.local_ranks
    if n <= 1 or send_bytes <= 0:
        return 0.0
    share = send_bytes / n
    t = 0.0
    if n > k:
        rate = p2p_rate_gbps(hw, comm, network=True, efficiency=efficiency, peers=n - k)
        t = max(t, p2p_latency_us(hw, network=True) * 1e-6 + (n - k) * share / (rate * 1e9))
    if k > 1:
        rate = hw.nvlink.p2p_gbps * efficiency
        t = max(t, p2p_latency_us(hw, network=False) * 1e-6 + (k - 1) * share / (rate * 1e9))
    return t


def _pow2_up(x: int) -> int:
    return 1 << (max(1, x) - 1).bit_length()
