"""The run's ``moe:`` section (where an MoE layer's routed experts run under PCP:
``pcpflow.parallel.moe_dispatch``) and its checks against the model and the rank grid,
without torch."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pcpflow.errors import Problem, Settings
from pcpflow.models.moe_config import MoEConfig, moe_config_problems


class MoERunConfig(Settings):
    """How MoE layers run under PCP (the ``moe:`` section)."""

    dispatch: Literal["local", "gather", "all_to_all"] | None = Field(
        None,
        description="local | gather | all_to_all (only for models with experts; None: local)",
    )


def model_moe(model_cfg) -> MoEConfig | None:
    """The MoE settings a model config implies (a checkpoint's, for ``model=hf``)."""
    if model_cfg.name == "hf":
        from pcpflow.models.hf_registry import read_checkpoint

        return getattr(read_checkpoint(model_cfg.path), "moe", None)
    return getattr(model_cfg, "moe", None)


def moe_problems(cfg) -> list[Problem]:
    """The ``moe`` section against the model and the rank grid (a ``RunConfig``)."""
    moe = model_moe(cfg.model)
    mode = cfg.moe.dispatch
    if moe is None:
        if mode is None:
            return []
        hint = (
            "model.moe.num_experts=N (e.g. model.moe.num_experts=8 model.moe.top_k=2)"
            if cfg.model.name == "tiny_mla"
            else "a model with experts"
        )
        allowed = f"model {cfg.model.name} has no experts: use {hint}, or leave moe.dispatch unset"
        return [Problem("moe.dispatch", mode, allowed)]
    out = moe_config_problems(moe) if cfg.model.name != "hf" else []
    w = cfg.grid.world_size  # NOTE: one pool's ranks (disagg=pd: each pool dispatches over its own)
    if mode == "all_to_all" and moe.num_experts % w:
        out.append(
            Problem(
                "moe.dispatch",
                mode,
                f"all_to_all shards experts over tp*pcp = {w} ranks: num_experts "
                f"({moe.num_experts}) must be divisible by {w}; or use local | gather",
            )
        )
    return out
