"""The settings of a simulated run: ``simulate.*`` (how to price) and ``hardware`` (what it
runs on, ``conf/hardware/<name>.yaml``, or a profile that ``mode=profile`` measured:
``hardware=measured hardware.path=FILE``). Numbers only; the operators that read them live in
``pcpflow.simulate`` (docs/simulate.md, docs/profile.md). No value may be infinite or NaN."""

from __future__ import annotations

import stat
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, Strict, ValidationInfo, field_validator, model_validator

from pcpflow.errors import Settings

PEAK_OF_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float64": "fp64"}
"""The one mapping from the run's ``dtype`` to a key of ``hardware.peak_tflops`` (activations,
attention, the KV cache at ``simulate.kv_dtype=bf16``). The GPU profiles have no ``fp64`` peak
(``float64`` is refused there); a measured CPU profile has one when it measured float64."""


class Peaks(Settings):
    """Dense (not sparse) peaks of one GPU, TFLOP/s, keyed by the operand dtype."""

    fp32: float | None = Field(gt=0, description="FP32 (no tensor cores: torch's float32 matmul), TFLOP/s; null: not measured")
    bf16: float | None = Field(gt=0, description="dense BF16 tensor-core peak, TFLOP/s; null: not measured")
    fp8: float | None = Field(gt=0, description="dense FP8 tensor-core peak, TFLOP/s; null: none (a CPU)")
    fp4: float | None = Field(None, gt=0, description="dense FP4 tensor-core peak, TFLOP/s; null: no FP4 tensor cores")
    fp64: float | None = Field(None, gt=0, description="FP64 matmul, TFLOP/s (a measured CPU profile); null: not priced")

    def of(self, key: str) -> float | None:
        return getattr(self, key)


class NcclGraph(Settings):
    """What NCCL's topology search (``src/graph/search.cc``) settles on for one algorithm's
    graph: its channels and each channel's bandwidth (``graph->nChannels``, ``bwIntra`` /
    ``bwInter``), the inputs of its tuning model (``src/graph/tuning.cc``)."""

    channels: int = Field(ge=1, description="graph->nChannels")
    channel_gbps: float = Field(gt=0, description="graph->bwIntra (or bwInter) of one channel, GB/s")
    inter_gbps: float | None = Field(
        None, gt=0, description="graph->bwInter where the search sets it apart from bwIntra (NVLS: pass 2 raises "
        "it, search.cc ncclTopoCompute); null: bwIntra")

    @property
    def bw_inter(self) -> float:
        return self.inter_gbps or self.channel_gbps

    @property
    def gbps(self) -> float:
        return self.channels * self.channel_gbps


class _Borrowed(Settings):
    """A section a measured profile could not measure names the profile it took it from."""

    model_config = ConfigDict(populate_by_name=True)

    from_: str | None = Field(
        None, alias="from", description="a measured profile: the shipped profile this section's numbers come from"
    )


class NVLink(_Borrowed):
    """Inside one node (NVLink through NVSwitch): the graphs NCCL searches for a communicator
    whose ranks share a node, and a point-to-point transfer's rate."""

    ring: NcclGraph
    tree: NcclGraph
    nvls: NcclGraph | None = Field(None, description="NVLink SHARP (NVSwitch multicast) graph; null: none")
    p2p_gbps: float = Field(gt=0, description="one send/recv to a peer in the node, GB/s")


class Network(_Borrowed):
    """Between nodes: one NIC per GPU. ``ring`` is the graph of a communicator with one GPU
    per node (each GPU of a node in the communicator brings its own NIC: ``Placement``)."""

    nic_gbps: float = Field(gt=0, description="line rate of one NIC, GB/s (what NCCL reads as the NET bandwidth)")
    ring: NcclGraph
    p2p_channel_gbps: float = Field(gt=0, description="what NCCL assumes one channel moves to a network peer, GB/s")
    latency_us: float = Field(0.0, ge=0, description="graph->latencyInter: the NET plugin's latency, microseconds")


class Host(Settings):
    """The CPU side of a step: launching kernels, replaying graphs."""

    launch_us: float = Field(gt=0, description="host time to launch one kernel eagerly (on a CPU: one op of "
                             "pcpflow's forward, dispatch included), microseconds")
    graph_launch_us: float | None = Field(
        gt=0, description="host time to launch one CUDA graph replay, microseconds; null: no graphs (a CPU: "
        "graph modes run their body eagerly)")
    kernels_per_layer: int | None = Field(
        None, ge=1, description="kernels one decoder layer launches; null: counted from pcpflow's own forward"
    )


class Overlap(Settings):
    """What hides behind what, per mechanism (docs/simulate.md, "Overlap, per mechanism").
    The engine's own collectives wait for their inputs and are waited for: always exposed."""

    host: bool = Field(
        True,
        description="the host launches ahead of the device and waits once per step, so a step lasts "
        "max(host, device) (a GPU); false: the host runs every op itself, its launches are part of each "
        "op's time and its own work adds (a CPU)",
    )
    p2p: bool = Field(
        True,
        description="point-to-point transfers run on their own stream beside compute: a ring's SendRecv "
        "hides behind its attention step (NCCL); false: they are exposed (gloo, one thread per rank)",
    )


class HeadShape(Settings):
    """A head shape the attention tables were measured at (a basis of the price): GQA
    (``heads`` query heads over ``kv_heads`` KV heads of ``head_dim``), or MLA's absorbed
    attention (``heads`` query heads over one latent of ``head_dim`` = kv_lora_rank plus
    ``rope_dim``, the latent its values)."""

    kind: Literal["gqa", "mla"] = "gqa"
    heads: int = Field(ge=1)
    kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    rope_dim: int = Field(0, ge=0, description="mla: the rope part of the latent entry")

    @model_validator(mode="after")
    def _mla(self) -> HeadShape:
        if self.kind == "mla" and self.kv_heads != 1:
            raise ValueError(f"an mla head shape has kv_heads=1 (one latent), not {self.kv_heads}")
        return self


Size = Annotated[int, Strict(), Field(ge=1)]
"""A point of a size axis (rows, keys, bytes, ...): at least 1. Strict, as every table entry:
an entry is a number as written, never a boolean or a string (``Settings`` checks a model's
own fields; these are list items)."""
Seconds = Annotated[float, Strict(), Field(gt=0)]
"""A measured time: finite (``Settings``) and above 0 (the profiler never measures 0)."""
Wait = Annotated[float, Strict(), Field(ge=0)]
"""A time 0 may be (a fitted excess clamped at 0, a point of a fit)."""


def _increasing(values: list, what: str = "") -> list:
    """A size axis: strictly increasing (the tables interpolate along it)."""
    if any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError(f"{what or 'a size axis'}: strictly increasing sizes (the tables interpolate along it)")
    return values


def _paired(values: list, info: ValidationInfo, other: str) -> list:
    """``values``, one per point of ``other`` (validated before it)."""
    given = info.data.get(other)
    if given is not None and len(values) != len(given):
        raise ValueError(f"one value per point of {other}: {len(given)} values, not {len(values)}")
    return values


class GemmTable(Settings):
    """Seconds of one ``F.linear`` of ``[m, k]`` by ``[n, k]`` at every point of the grid."""

    m: list[Size] = Field(min_length=1)
    n: list[Size] = Field(min_length=1)
    k: list[Size] = Field(min_length=1)
    seconds: list[list[list[Seconds]]] = Field(description="[m][n][k], seconds of one call")

    _axes = field_validator("m", "n", "k")(_increasing)

    @field_validator("seconds")
    @classmethod
    def _shape(cls, v: list, info: ValidationInfo) -> list:
        if all(a in info.data for a in "mnk"):
            _check_grid(v, [(a, info.data[a]) for a in "mnk"])
        return v


class AttentionTable(Settings):
    """One phase of one dtype through the attention backend: seconds of one call (the KV write
    and the kernel) with ``rows`` query rows over ``keys`` keys each, per basis head shape."""

    rows: list[Size] = Field(min_length=1)
    keys: list[Size] = Field(min_length=1)
    seconds: list[list[list[Seconds]]] = Field(description="[rows][keys][basis]")

    _axes = field_validator("rows", "keys")(_increasing)

    @field_validator("seconds")
    @classmethod
    def _shape(cls, v: list, info: ValidationInfo) -> list:
        if "rows" in info.data and "keys" in info.data:
            _check_grid(v, [("rows", info.data["rows"]), ("keys", info.data["keys"])])
        return v


class AttentionTables(Settings):
    backend: str = Field(description="the paged-attention kernel measured (pipeline.forward.attention resolved)")
    block_size: int = Field(16, ge=1, description="the KV cache's block size the calls were timed at (kv.block_size): "
                            "the reference kernel pads each tile's context to whole blocks")
    basis: list[HeadShape] = Field(
        min_length=4,
        description="the head shapes measured (at least four GQA ones; MLA is priced on its own "
        "shapes when four or more were measured)",
    )
    prefill: dict[str, AttentionTable] = Field(default_factory=dict, description="by dtype: one request's chunk")
    decode: dict[str, AttentionTable] = Field(default_factory=dict, description="by dtype: one row per request")

    @model_validator(mode="after")
    def _shape(self) -> AttentionTables:
        if sum(b.kind == "gqa" for b in self.basis) < 4:
            raise ValueError("basis: at least four gqa head shapes (four coefficients are fitted on them)")
        for phase in ("prefill", "decode"):
            for dtype, t in getattr(self, phase).items():
                _check_grid(t.seconds, [("rows", t.rows), ("keys", t.keys), ("basis", self.basis)],
                            at=(phase, dtype, "seconds"))
        return self


class _BySize(Settings):
    """Seconds measured at increasing sizes in bytes, one per size."""

    bytes: list[Size] = Field(min_length=1)
    seconds: list[Seconds] = Field(min_length=1)

    _axes = field_validator("bytes")(_increasing)

    @field_validator("seconds")
    @classmethod
    def _paired(cls, v: list, info: ValidationInfo) -> list:
        return _paired(v, info, "bytes")


class MemoryTable(_BySize):
    """Streaming: seconds of a copy of ``bytes`` (read once, written once)."""


class LaunchTable(Settings):
    op_us: float = Field(gt=0, description="one trivial op (a one-element add), microseconds")
    layer_op_us: dict[str, Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict,
        description="per attention kind (gqa, mla): a pcpflow decoder layer at minimal widths, its time over "
        "its counted ops (views and the module code included), microseconds")
    graph_replay_us: float | None = Field(None, gt=0, description="one CUDA graph replay (GPU), microseconds")


class HostTable(Settings):
    """pcpflow's per-step host work outside the forward (scheduler, validate, plan, buffers,
    slots, the restore's indexing and sampling), and its fit ``fixed + per_request x requests +
    per_token x tokens``."""

    requests: list[Size] = Field(min_length=1)
    tokens: list[Size] = Field(min_length=1)
    seconds: list[Wait] = Field(min_length=1)
    fixed_us: float = Field(ge=0)
    per_request_us: float = Field(ge=0)
    per_token_us: float = Field(ge=0)

    @field_validator("tokens", "seconds")
    @classmethod
    def _paired(cls, v: list, info: ValidationInfo) -> list:
        return _paired(v, info, "requests")


class SyncTable(Settings):
    """How long a collective waits for the slowest rank beyond its own cost, after ``work_s``
    of work on every rank (means: with every core busy, what else the machine runs delays one
    rank and the others wait), and its fit ``fixed + per_work x work``."""

    work_s: list[Seconds] = Field(min_length=1)
    excess_s: list[Wait] = Field(min_length=1, description="0 when the call waited no longer than alone")
    fixed_us: float = Field(ge=0)
    per_work: float = Field(ge=0)

    @field_validator("excess_s")
    @classmethod
    def _paired(cls, v: list, info: ValidationInfo) -> list:
        return _paired(v, info, "work_s")


COLLECTIVE_OPS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "broadcast", "sendrecv")


class CollectiveTable(_BySize):
    """One collective on one group of the profiled grid, by one rank's tensor bytes (an
    all-gather's shard, a reduce-scatter's whole input, a send's tensor), and its fit
    ``latency + bytes / bandwidth`` on its own points."""

    group: str = Field(description="the grid's group it ran on: tp, pcp, dcp, dcp_heads or world")
    ranks: int = Field(ge=2)
    op: Literal[COLLECTIVE_OPS]  # type: ignore[valid-type]
    latency_us: float = Field(ge=0)
    gbps: float = Field(gt=0)


class Tables(Settings):
    """What ``mode=profile`` measured (docs/profile.md); the price interpolates them and falls
    back to the roofline with the measured peaks outside. ``mode=profile`` always writes
    gemm, attention, memory, launch and host (the price has no right substitute for any of
    them: required); collectives and sync only with more than one rank. Times are finite and
    above 0 (a sync excess or a host point may be 0), sizes at least 1, size axes strictly
    increasing, paired lists of one length."""

    gemm: dict[str, GemmTable] = Field(min_length=1, description="by dtype (float32, bfloat16, ...)")
    attention: AttentionTables
    memory: MemoryTable
    launch: LaunchTable
    host: HostTable
    collectives: list[CollectiveTable] = Field(
        default_factory=list, description="none on a profile of one rank (no collective ran)")
    sync: SyncTable | None = Field(None, validate_default=True,
                                   description="with collectives: required; null: one rank, no collective")

    @field_validator("sync")
    @classmethod
    def _sync(cls, v, info: ValidationInfo):
        if v is None and info.data.get("collectives"):
            raise ValueError("a profile with collectives measured how long they wait for the slowest rank "
                             "(sync: work_s, excess_s, fixed_us, per_work; mode=profile writes it with them); "
                             "run mode=profile again")
        return v


class Measured(Settings):
    """Where and when a profile was measured; ``status: partial`` says it was interrupted and
    ``missing`` what it lacks (a simulated run refuses it)."""

    date: str
    device: str = Field(description="what the ranks computed on")
    torch: str
    backend: str = Field(description="the collective backend and its version")
    tp: int = Field(ge=1)
    pcp: int = Field(ge=1)
    threads_per_rank: int = Field(ge=1)
    cpu_bind: Literal["none", "cores"] = Field("none", description="where its ranks' threads ran (``cpu_bind``)")
    dtypes: list[str]
    quick: bool
    status: Literal["complete", "partial"]
    missing: list[str] = Field(default_factory=list)
    elapsed_s: float = Field(ge=0)
    section_s: dict[str, float] = Field(default_factory=dict, description="seconds each section took")
    load_average: list[float] = Field(default_factory=list, description="1, 5 and 15 min, when it started")


class HardwareConfig(Settings):
    """One GPU type in nodes of ``gpus_per_node``: NVLink inside a node, ``network`` between
    (one NIC per GPU); or a host measured by ``mode=profile`` (``measured``, ``tables``; a CPU
    host's ranks are its cores). Every number in ``conf/hardware/*.yaml`` cites its source."""

    name: str
    device: Literal["gpu", "cpu"] = Field("gpu", description="what the ranks compute on")
    arch: Literal["hopper", "blackwell"] | None = Field(
        None, description="NCCL's compute-capability row of its tuning tables (a GPU)")
    cpu: Literal["intel", "amd", "other"] = Field(description="host CPU vendor (NCCL's LL bandwidth row, net overhead)")
    gpus_per_node: int = Field(ge=1, description="devices per node (a CPU host: the ranks it runs at once)")
    sm_count: int | None = Field(None, ge=1, description="streaming multiprocessors (GEMM waves; a GPU)")
    hbm_gib: float = Field(gt=0, description="HBM capacity per GPU (a CPU: host memory), GiB")
    hbm_tbps: float = Field(gt=0, description="HBM bandwidth per GPU (a CPU: measured streaming), TB/s")
    peak_tflops: Peaks
    kernel_floor_us: float = Field(ge=0, description="the least time a kernel takes on the GPU, microseconds")
    nvlink: NVLink | None = Field(None, description="NCCL's graphs inside a node; null: collectives measured")
    network: Network | None = Field(None, description="NCCL's graphs between nodes; null: collectives measured")
    host: Host
    overlap: Overlap = Field(default_factory=Overlap)
    path: str | None = Field(None, description="hardware=measured: the profile file (mode=profile's hardware.yaml)")
    measured: Measured | None = Field(None, description="a measured profile: where, when, complete or partial")
    tables: Tables | None = Field(None, validate_default=True,
                                  description="a measured profile's tables (docs/profile.md)")

    @field_validator("tables")
    @classmethod
    def _measured(cls, v, info: ValidationInfo):
        if v is None and info.data.get("measured") is not None:
            raise ValueError("a measured profile (it has measured) holds the tables mode=profile measured: gemm, "
                             "attention, memory, launch, host (and collectives, sync with more than one rank); "
                             "run mode=profile again")
        return v

    @model_validator(mode="after")
    def _complete(self) -> HardwareConfig:
        nccl = [k for k in ("arch", "nvlink", "network") if getattr(self, k) is None]
        if nccl and len(nccl) < 3:
            raise ValueError(f"NCCL's model needs arch, nvlink and network together; missing: {', '.join(nccl)}")
        # NOTE: without NCCL's graphs, collectives come from the tables; a run with a group the
        # profile did not measure is refused (pcpflow.simulate.prepare.measured_problems).
        # NOTE: a measured profile's tables are checked on their own (``Tables``: gemm required)
        if self.sm_count is None and self.tables is None and not self.path:
            raise ValueError("no way to price GEMMs: set sm_count (tiles in waves) or measure them (tables.gemm)")
        return self

    def peak(self, key: str) -> float | None:
        return self.peak_tflops.of(key)

    @property
    def nccl(self) -> bool:
        """Collectives can be priced by NCCL's model (arch, nvlink, network set)."""
        return self.nvlink is not None


def load_profile(path: str | None) -> dict:
    """The values of a measured profile file (``hardware=measured hardware.path=FILE``), with
    ``path`` set; ValueError saying what is wrong with the file (missing, not a regular file,
    empty, not YAML, not a profile, partial: what it lacks)."""
    from pathlib import Path

    import yaml

    if not path:
        raise ValueError("hardware=measured loads a profile: hardware.path=<profile run dir>/hardware.yaml "
                         "(python -m pcpflow mode=profile writes one)")
    file = Path(path).expanduser()
    try:
        mode = file.stat().st_mode
    except (FileNotFoundError, NotADirectoryError) as exc:
        where = "" if isinstance(exc, FileNotFoundError) else ": a folder on its path is a file"
        raise ValueError(f"a profile file that exists ({file} does not exist{where}); python -m pcpflow mode=profile "
                         "writes <run dir>/hardware.yaml") from None
    except OSError as exc:
        raise ValueError(f"a profile file pcpflow can read; {file}: {exc.strerror or exc}") from None
    if stat.S_ISDIR(mode):
        raise ValueError(f"a profile file; {file} is a directory (mode=profile writes <run dir>/hardware.yaml)")
    if not stat.S_ISREG(mode):
        raise ValueError(f"a profile file; {file} exists but is not a regular file ({_file_kind(mode)}); "
                         "python -m pcpflow mode=profile writes <run dir>/hardware.yaml")
    try:
        text = file.read_text()
        values = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"a YAML hardware profile; {file} does not parse: {' '.join(str(exc).split())}") from None
    if values is None:
        raise ValueError(f"a hardware profile; the profile file {file} "
                         f"{'holds no values' if text.strip() else 'is empty'}: python -m pcpflow mode=profile "
                         "writes <run dir>/hardware.yaml")
    if not isinstance(values, dict) or "name" not in values:
        raise ValueError(f"a hardware profile (a mapping with name, peak_tflops, host, ...); {file} is not one")
    if values.get("tables") is not None and values.get("measured") is None:
        raise ValueError(f"a measured profile; {file} has tables but no measured section (date, device, status, "
                         "...: mode=profile writes it, and a partial profile is known by it); run mode=profile again")
    measured = values.get("measured") or {}
    if isinstance(measured, dict) and measured.get("status") == "partial":
        missing = ", ".join(map(str, measured.get("missing") or [])) or "unknown sections"
        raise ValueError(f"a complete profile; {file} is partial (mode=profile was interrupted): it lacks "
                         f"{missing}; run mode=profile again")
    return {**values, "path": str(file)}


def _file_kind(mode: int) -> str:
    """What a path that exists but is neither a regular file nor a directory is, in words."""
    kinds = [(stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a named pipe"),
             (stat.S_ISSOCK, "a socket")]
    return next((words for test, words in kinds if test(mode)), "not a file pcpflow can read")


class EntryError(ValueError):
    """A problem of one entry inside a field's value: ``loc`` below the field (keys and
    indices), ``given`` what is there. ``pcpflow.config.run.pydantic_problems`` names the
    entry, not the whole value (a table of a thousand numbers)."""

    def __init__(self, message: str, loc: tuple = (), given: Any = None) -> None:
        super().__init__(message)
        self.loc, self.given = tuple(loc), given


class Entries(int):
    """A list's length, shown as what it is (``3 entries``) where a problem quotes it."""

    def __repr__(self) -> str:
        return f"{int(self)} entries"


def _check_grid(values: list, axes: list[tuple[str, list]], at: tuple = ()) -> None:
    """``values`` nested one list per axis, each list one entry per point of its axis;
    EntryError naming the first list that is not (its index path below ``at``, the points it
    lies at, the length it needs)."""
    names = "".join(f"[{name}]" for name, _ in axes)
    shape = " x ".join(str(len(points)) for _, points in axes)

    def walk(node: list, path: tuple[int, ...]) -> None:
        name, points = axes[len(path)]
        if len(node) != len(points):
            per = "head shape of basis" if name == "basis" else f"point of {name}"
            where = ", ".join(f"{axes[d][0]}={axes[d][1][i]}" for d, i in enumerate(path))
            raise EntryError(f"{len(points)} entries, one per {per} (seconds must be {shape}, {names})"
                             + (f"; this list is at {where}" if where else ""), loc=(*at, *path), given=Entries(len(node)))
        if len(path) + 1 < len(axes):
            for i, child in enumerate(node):
                walk(child, (*path, i))

    walk(values, ())


REMOVED_SIMULATE = {
    "ring_step_us": "removed: a ring iteration is priced by its operators (its SendRecv as point-to-point "
    "transfers, its partial attention by shape, the host launching its kernels: hardware.host.launch_us); "
    "nothing replaces the fixed time",
    "attention_efficiency": "removed: prefill attention runs at FlashAttention-3's published throughput for "
    "the shapes of its calls (arXiv 2407.08608 Figure 5, pcpflow.simulate.flash), not one share of the peak",
    "overlap": "removed: what hides behind what is decided per mechanism; the algorithm that runs is "
    "simulate.cp_decode (engine | ring_pass_q) for decodes and pipeline.forward.cp_attention for prefills",
}


EXPERT_DTYPES = ("bf16", "fp8", "fp4", "mxfp4", "fp32", "fp64")
"""What ``simulate.expert_weights_dtype`` takes: ``weights_dtype``'s and mxfp4."""


class SimulateConfig(Settings):
    """How a simulated run prices a step (``pcpflow.simulate``). Two factors are fitted
    (``FITTED``, docs/simulate.md says on what); every other number comes from the hardware
    profile's sources."""

    REMOVED: ClassVar[dict[str, str]] = REMOVED_SIMULATE  # set, they exit 2 with this (config.run)
    FITTED: ClassVar[dict[str, str]] = {
        "gemm_efficiency": "arXiv 2411.01783 Table 6: 1 node x TP8, 8K context, TTFT 1,740 ms (GEMM-bound)",
        "p2p_efficiency": "arXiv 2411.01783 Table 5: the four SendRecv times of the CP4 ring (point-to-point only)",
    }

    weights_dtype: Literal["bf16", "fp8", "fp4", "fp32", "fp64"] | None = Field(
        None,
        description="linear-layer weights and their GEMMs' peak: bf16 | fp8 | fp4 (refused on hardware "
        "without an fp4 peak) | fp32 | fp64; null: the card's checkpoint dtype (fp8 for DeepSeek-V3, bf16 "
        "otherwise; a tiny model on a measured profile: the run's dtype)",
    )
    expert_weights_dtype: Literal[EXPERT_DTYPES] | None = Field(  # type: ignore[valid-type]
        None,
        description="the routed experts' weights and their GEMMs' peak: bf16 | fp8 | fp4 (W4A4 at the fp4 peak: "
        "refused on hardware without one) | mxfp4 (W4A16: 4.25 bits a weight read, dequantized in the kernel, at "
        "the activations' peak, as vLLM runs gpt-oss on Hopper and by default on Blackwell) | fp32 | fp64; shared "
        "experts and routers follow weights_dtype; null: the card's expert_weights_dtype, then weights_dtype",
    )
    kv_dtype: Literal["bf16", "fp8"] = Field(
        "bf16", description="the KV cache: sizes its blocks, its reads and the KV it moves"
    )
    cp_decode: Literal["engine", "ring_pass_q"] = Field(
        "engine",
        description="the algorithm decodes run under DCP: engine (the executed path: dcp_comm_backend, "
        "dcp_rest) | ring_pass_q (a step of decodes only runs the executed ring pass-Q; needs dcp = pcp > 1)",
    )
    draft_acceptance: list[Annotated[float, Field(ge=0, le=1)]] | None = Field(
        None, min_length=1,
        description="drafting: the probability that draft j is accepted when the drafts before it were, "
        "per position (a shorter list repeats its last entry), drawn per step from seed + the drafter's "
        "seed_offset; null: draft=self takes 1 - its error_rate, drawn as the executed run draws it (the "
        "counts are the executed run's); mtp and dspark need it (their acceptance is their trained weights')",
    )
    draft_layer: Literal["auto", "config", "target"] = Field(
        "auto",
        description="what an mtp / dspark drafter's layers are priced as: config (draft.layer, the layers an "
        "executed run builds: its counts are the executed run's) | target (each one of the target's own decoder "
        "layers, MoE included: DeepSeek-V3's MTP module is one more layer of the model) | auto (target on a model "
        "card or a checkpoint's config.json, config on tiny_mla / tiny_gqa)",
    )
    gemm_efficiency: float = Field(
        0.4235, gt=0, le=1, description="share of the tensor peak a GEMM's tiles reach (fitted)"
    )
    p2p_efficiency: float = Field(
        0.4646, gt=0, le=1,
        description="share of NCCL's point-to-point rate (its channels to a peer, at most the link) a "
        "send/recv or all-to-all reaches (fitted)",
    )
    hbm_efficiency: float = Field(
        0.9, gt=0, le=1,
        description="share of HBM bandwidth memory-bound kernels reach (not fitted: H100 STREAM triad)",
    )
    objective: Literal["ttft", "tpot", "gpus", "ttft_x_gpus", "tpot_x_gpus", "throughput_per_gpu",
                       "goodput_per_gpu"] = Field(
        "ttft", description="what a sweep report and a search rank by: ttft, tpot, gpus, ttft_x_gpus, "
        "tpot_x_gpus (lower is better; x_gpus: GPU-seconds), throughput_per_gpu (output tokens/s), "
        "goodput_per_gpu (requests/s meeting the SLOs; needs slo.*) (higher is better)"
    )
    hbm_utilization: float = Field(
        0.90, gt=0, le=1, description="share of HBM the engine may use (weights + KV cache)"
    )

    def drafter_layers(self, model: Any) -> Literal["config", "target"]:
        """``draft_layer`` resolved for ``model``: ``auto`` is ``target`` on a model card (a
        card or a checkpoint's config.json: sizes, no drafter of pcpflow's to build) and
        ``config`` on a model an executed run builds (its drafter is ``draft.layer``)."""
        if self.draft_layer != "auto":
            return self.draft_layer
        from pcpflow.models.card import ModelCard

        return "target" if isinstance(model, ModelCard) else "config"
