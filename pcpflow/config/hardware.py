"""The settings of a simulated run: ``simulate.*`` (how to price) and ``hardware`` (what it
runs on, ``conf/hardware/<name>.yaml``). Numbers only; the operators that read them live in
``pcpflow.simulate`` (docs/simulate.md). No value may be infinite or NaN."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


PEAK_OF_DTYPE = {"float32": "fp32", "bfloat16": "bf16"}
"""The one mapping from the run's ``dtype`` to a key of ``hardware.peak_tflops`` (activations,
attention, the KV cache at ``simulate.kv_dtype=bf16``). ``float64`` has no tensor peak here."""


class Peaks(_Strict):
    """Dense (not sparse) peaks of one GPU, TFLOP/s, keyed by the operand dtype."""

    fp32: float = Field(gt=0, description="FP32 (no tensor cores: torch's float32 matmul), TFLOP/s")
    bf16: float = Field(gt=0, description="dense BF16 tensor-core peak, TFLOP/s")
    fp8: float = Field(gt=0, description="dense FP8 tensor-core peak, TFLOP/s")
    fp4: float | None = Field(None, gt=0, description="dense FP4 tensor-core peak, TFLOP/s; null: no FP4 tensor cores")

    def of(self, key: str) -> float | None:
        return getattr(self, key)


class NcclGraph(_Strict):
    """What NCCL's topology search (``src/graph/search.cc``) settles on for one algorithm's
    graph: its channels and each channel's bandwidth (``graph->nChannels``, ``bwIntra`` /
    ``bwInter``), the inputs of its tuning model (``src/graph/tuning.cc``)."""

    channels: int = Field(ge=1, description="graph->nChannels")
    channel_gbps: float = Field(gt=0, description="graph->bwIntra (or bwInter) of one channel, GB/s")

    @property
    def gbps(self) -> float:
        return self.channels * self.channel_gbps


class NVLink(_Strict):
    """Inside one node (NVLink through NVSwitch): the graphs NCCL searches for a communicator
    whose ranks share a node, and a point-to-point transfer's rate."""

    ring: NcclGraph
    tree: NcclGraph
    nvls: NcclGraph | None = Field(None, description="NVLink SHARP (NVSwitch multicast) graph; null: none")
    p2p_gbps: float = Field(gt=0, description="one send/recv to a peer in the node, GB/s")


class Network(_Strict):
    """Between nodes: one NIC per GPU. ``ring`` is the graph of a communicator with one GPU
    per node (each GPU of a node in the communicator brings its own NIC: ``Placement``)."""

    nic_gbps: float = Field(gt=0, description="line rate of one NIC, GB/s (what NCCL reads as the NET bandwidth)")
    ring: NcclGraph
    p2p_channel_gbps: float = Field(gt=0, description="what NCCL assumes one channel moves to a network peer, GB/s")
    latency_us: float = Field(0.0, ge=0, description="graph->latencyInter: the NET plugin's latency, microseconds")


class Host(_Strict):
    """The CPU side of a step: launching kernels, replaying graphs."""

    launch_us: float = Field(gt=0, description="host time to launch one kernel eagerly, microseconds")
    graph_launch_us: float = Field(gt=0, description="host time to launch one CUDA graph replay, microseconds")
    kernels_per_layer: int | None = Field(
        None, ge=1, description="kernels one decoder layer launches; null: counted from pcpflow's own forward"
    )


class HardwareConfig(_Strict):
    """One GPU type in nodes of ``gpus_per_node``: NVLink inside a node, ``network`` between
    (one NIC per GPU). Every number in ``conf/hardware/*.yaml`` cites its source."""

    name: str
    arch: Literal["hopper", "blackwell"] = Field(description="NCCL's compute-capability row of its tuning tables")
    cpu: Literal["intel", "amd"] = Field(description="host CPU vendor (NCCL's LL bandwidth row, net overhead)")
    gpus_per_node: int = Field(ge=1)
    sm_count: int = Field(ge=1, description="streaming multiprocessors (GEMM waves)")
    hbm_gib: float = Field(gt=0, description="HBM capacity per GPU, GiB")
    hbm_tbps: float = Field(gt=0, description="HBM bandwidth per GPU, TB/s")
    peak_tflops: Peaks
    kernel_floor_us: float = Field(ge=0, description="the least time a kernel takes on the GPU, microseconds")
    nvlink: NVLink
    network: Network
    host: Host

    def peak(self, key: str) -> float | None:
        return self.peak_tflops.of(key)


REMOVED_SIMULATE = {
    "ring_step_us": "removed: a ring iteration is priced by its operators (its SendRecv as point-to-point "
    "transfers, its partial attention by shape, the host launching its kernels: hardware.host.launch_us); "
    "nothing replaces the fixed time",
    "attention_efficiency": "removed: prefill attention runs at FlashAttention-3's published throughput for "
    "the shapes of its calls (arXiv 2407.08608 Figure 5, pcpflow.simulate.flash), not one share of the peak",
    "overlap": "removed: what hides behind what is decided per mechanism; the algorithm that runs is "
    "simulate.cp_decode (engine | ring_pass_q) for decodes and pipeline.forward.cp_attention for prefills",
}


class SimulateConfig(_Strict):
    """How a simulated run prices a step (``pcpflow.simulate``). Two factors are fitted
    (``FITTED``, docs/simulate.md says on what); every other number comes from the hardware
    profile's sources."""

    REMOVED: ClassVar[dict[str, str]] = REMOVED_SIMULATE  # set, they exit 2 with this (config.run)
    FITTED: ClassVar[dict[str, str]] = {
        "gemm_efficiency": "arXiv 2411.01783 Table 6: 1 node x TP8, 8K context, TTFT 1,740 ms (GEMM-bound)",
        "p2p_efficiency": "arXiv 2411.01783 Table 5: the four SendRecv times of the CP4 ring (point-to-point only)",
    }

    weights_dtype: Literal["bf16", "fp8", "fp4"] | None = Field(
        None,
        description="linear-layer weights and their GEMMs' peak: bf16 | fp8 | fp4 (refused on hardware "
        "without an fp4 peak); null: the card's checkpoint dtype (fp8 for DeepSeek-V3, bf16 otherwise)",
    )
    kv_dtype: Literal["bf16", "fp8"] = Field(
        "bf16", description="the KV cache: sizes its blocks, its reads and the KV it moves"
    )
    cp_decode: Literal["engine", "ring_pass_q"] = Field(
        "engine",
        description="the algorithm decodes run under DCP: engine (the executed path: dcp_comm_backend, "
        "dcp_rest) | ring_pass_q (a step of decodes only runs the executed ring pass-Q; needs dcp = pcp > 1)",
    )
    gemm_efficiency: float = Field(
        0.4553, gt=0, le=1, description="share of the tensor peak a GEMM's tiles reach (fitted)"
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
