"""The settings of a simulated run: ``simulate.*`` (how to price) and ``hardware``
(what it runs on, ``conf/hardware/<name>.yaml``). Numbers only; no pricing here."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Link(_Strict):
    busbw_gbps: float = Field(gt=0, description="NCCL bus bandwidth of one GPU on this link, GB/s")
    latency_us: float = Field(ge=0, description="latency of one ring hop, microseconds")


class Peaks(_Strict):
    bf16: float = Field(gt=0, description="dense BF16 tensor-core peak, TFLOP/s")
    fp8: float = Field(gt=0, description="dense FP8 tensor-core peak, TFLOP/s")


class HardwareConfig(_Strict):
    """One GPU type in nodes of ``gpus_per_node``: NVLink inside a node, ``network`` between:
    one NIC per GPU, ``network.busbw_gbps`` one NIC's (a group with k GPUs in each node
    drives k NICs: ``pcpflow.simulate.price.Placement``)."""

    name: str
    gpus_per_node: int = Field(ge=1)
    hbm_gib: float = Field(gt=0, description="HBM capacity per GPU, GiB")
    hbm_tbps: float = Field(gt=0, description="HBM bandwidth per GPU, TB/s")
    peak_tflops: Peaks
    nvlink: Link
    network: Link


class SimulateConfig(_Strict):
    """How a simulated run prices a step (``pcpflow.simulate.price``). The efficiencies and
    ``ring_step_us`` are the model's only free parameters; docs/simulate.md says which
    published figure fits each (``gemm_efficiency``, ``ring_step_us``) and where the others
    come from."""

    weights_dtype: Literal["bf16", "fp8"] | None = Field(
        None,
        description="linear-layer weights and GEMMs: bf16 | fp8 (attention stays bf16); null: the "
        "card's checkpoint dtype (fp8 for DeepSeek-V3, bf16 otherwise)",
    )
    overlap: Literal["ring", "none"] = Field(
        "ring",
        description="ring: the KV / query exchange before attention runs in P-1 ring hops, each "
        "hidden behind the attention of the chunk before (Meta's ring); none: exposed",
    )
    gemm_efficiency: float = Field(0.383, gt=0, le=1, description="share of the dense tensor peak GEMMs reach")
    attention_efficiency: float = Field(
        0.675, gt=0, le=1, description="share of the BF16 peak the attention kernel reaches"
    )
    ring_step_us: float = Field(
        543.0, ge=0, description="fixed time of one ring iteration in one layer that the ring does not "
        "hide, microseconds (not paid by a step replayed as a full CUDA graph)",
    )
    hbm_efficiency: float = Field(0.80, gt=0, le=1, description="share of HBM bandwidth streaming reads reach")
    objective: Literal["ttft", "tpot", "gpus", "ttft_x_gpus", "tpot_x_gpus"] = Field(
        "ttft", description="what a sweep report ranks jobs by (lower is better; x_gpus: GPU-seconds)"
    )
    hbm_utilization: float = Field(
        0.90, gt=0, le=1, description="share of HBM the engine may use (weights + KV cache)"
    )
