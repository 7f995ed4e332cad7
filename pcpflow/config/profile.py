"""The settings of ``mode=profile`` (``profile.*``): what ``pcpflow.profile`` measures on the
run's ranks, and where a section it cannot measure takes its numbers from (docs/profile.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pcpflow.errors import Settings

PROFILE_DTYPES = ("float32", "float64", "bfloat16")


class ProfileConfig(Settings):
    quick: bool = Field(
        False, description="a reduced grid (<= 20 s on 2 cores: tests); false: the full grid (<= 3 min)"
    )
    dtypes: list[Literal[PROFILE_DTYPES]] | None = Field(  # type: ignore[valid-type]
        None,
        min_length=1,
        description="the dtypes its GEMM and attention tables cover; null: the device's (CPU: float32, "
        "float64, bfloat16; CUDA: bfloat16, float32; quick: the first)",
    )
    collectives_from: str = Field(
        "h200_sxm",
        description="a shipped hardware profile whose NCCL graphs price the collectives it cannot measure "
        "(one GPU); its name goes into the file (from:)",
    )
