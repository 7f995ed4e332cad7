"""The settings of ``mode=profile`` (``profile.*``): what ``pcpflow.profile`` measures on the
run's ranks, and where a section it cannot measure takes its numbers from (docs/profile.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from pcpflow.config.choices import choice_word, did_you_mean
from pcpflow.errors import Settings

PROFILE_DTYPES = ("float32", "float64", "bfloat16")


class ProfileConfig(Settings):
    quick: bool = Field(
        False, description="a reduced grid (<= 20 s on 2 cores: tests); false: the full grid (<= 3 min)"
    )
    dtypes: list[Literal[PROFILE_DTYPES]] | None = Field(  # type: ignore[valid-type]
        None,
        min_length=1,
        description="the dtypes its GEMM and attention tables cover, each at most once; null: the device's (CPU: "
        "float32, float64, bfloat16; CUDA: bfloat16, float32; quick: the first)",
    )
    collectives_from: str = Field(
        "h200_sxm",
        description="a shipped hardware profile whose NCCL graphs price the collectives it cannot measure "
        "(one GPU); its name goes into the file (from:)",
    )

    @field_validator("dtypes", mode="before")
    @classmethod
    def _each_once(cls, v: Any) -> Any:
        """One problem for the list: a name that is not a dtype and a dtype given twice are
        said together, each name once (not once per entry)."""
        if not isinstance(v, list):
            return v  # pydantic names what is not a list
        names = [choice_word(x) for x in v]  # NOTE: 3 or true as typed: not a dtype name either
        said = []
        for name in dict.fromkeys(names):
            what = []
            if name not in PROFILE_DTYPES:
                what.append("is not a dtype name" + did_you_mean(name, PROFILE_DTYPES, cutoff=0.5))
            if names.count(name) > 1:
                what.append(f"given {names.count(name)} times" if what else f"is given {names.count(name)} times")
            if what:
                said.append(f"{name} {', '.join(what)}")
        if said:
            raise ValueError(f"{'; '.join(said)}; allowed: {', '.join(PROFILE_DTYPES)}, each at most once")
        return v
