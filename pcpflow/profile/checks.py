"""What ``mode=profile`` refuses before any rank starts (``pcpflow.driver.checks``): a world
this machine cannot run with every rank busy on its own core, a ``collectives_from``
that is no shipped profile with NCCL's graphs, any stage that is not pcpflow's own, and a drafter."""

from __future__ import annotations

import os
from pathlib import Path

from pcpflow.errors import Problem


def profile_problems(cfg) -> list[Problem]:
    p: list[Problem] = []
    if cfg.mode != "profile":
        return p
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    want = cfg.world_size * cfg.threads_per_rank
    if cfg.device == "cpu" or not _cuda():
        if want > cores:
            field = "pcp" if cfg.pcp > 1 else "tp"
            p.append(Problem(field, getattr(cfg, field),
                             f"a profile measures with every rank on a core of its own: tp*pcp = {cfg.world_size} "
                             f"ranks x threads_per_rank={cfg.threads_per_rank} need {want} cores, this machine has "
                             f"{cores}; profile tp*pcp <= {max(cores // cfg.threads_per_rank, 1)}"))
    shipped = _shipped()
    if cfg.profile.collectives_from not in shipped:
        p.append(Problem("profile.collectives_from", cfg.profile.collectives_from,
                         f"a shipped profile with NCCL's graphs: one of {', '.join(shipped)}"))
    return p


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - no torch, no CUDA
        return False


def _shipped() -> list[str]:
    import yaml

    from pcpflow.paths import conf_dir

    out = []
    for path in sorted((Path(conf_dir()) / "hardware").glob("*.yaml")):
        values = yaml.safe_load(path.read_text()) or {}
        if isinstance(values, dict) and values.get("nvlink"):
            out.append(path.stem)
    return out


SHIPPED_ONLY = "mode=profile measures the shipped stages only"
NO_DRAFTING = "a setting of mode=execute: mode=profile measures the shipped engine without drafting; leave it out"


def shipped_stage_problems(cfg) -> list[Problem]:
    """A profile's host section times pcpflow's own engine (``sections.host``): a user's plugins,
    extra stages or a slot swapped to a stage of theirs would be measured as if pcpflow's, or
    break it; it runs without a drafter, so a draft stage would be accepted and ignored. Called
    once the plugins are imported, so that a kind of theirs is known as theirs."""
    from pcpflow.pipeline.assemble import SLOTS, builtin_kinds, is_builtin
    from pcpflow.pipeline.stage import UnknownStageError, load_stage_sources, resolve

    if cfg.mode != "profile":
        return []
    try:  # an installed package's stages (the entry-point group) are no more pcpflow's than a plugin's
        load_stage_sources()
    except Exception:  # noqa: BLE001 - the pipeline's own checks report a broken entry point
        pass
    p: list[Problem] = []
    if cfg.plugins:
        p.append(Problem("plugins", cfg.plugins, f"none: {SHIPPED_ONLY}; leave them out of the profile's command"))
    if cfg.pipeline.get("extra"):
        p.append(Problem("pipeline.extra", cfg.pipeline["extra"], f"none: {SHIPPED_ONLY}"))
    p += _drafting_problems(cfg)
    for slot in (s for s in SLOTS if s != "draft"):
        stage = cfg.pipeline.get(slot)
        kind = stage.get("kind") if isinstance(stage, dict) else None
        try:
            cls = resolve(str(kind), slot) if kind else None
        except UnknownStageError:  # the pipeline's own checks name it, with the known kinds
            continue
        if cls is not None and not is_builtin(cls):
            p.append(Problem(f"pipeline.{slot}.kind", kind, f"one of {', '.join(builtin_kinds(slot))} (pcpflow's own): "
                             f"{SHIPPED_ONLY}"))
    return p


def _drafting_problems(cfg) -> list[Problem]:
    """A draft stage, named where it is set: the draft group (draft=mtp), or pipeline.draft.kind
    (a plugin's drafter, whose settings are then moot as well)."""
    kind = cfg.draft_stage_config().get("kind", "none")
    if kind == "none":
        return []
    if kind == cfg.draft.get("kind"):
        return [Problem("draft", kind, f"{NO_DRAFTING} (draft=none)")]
    return [Problem("pipeline.draft.kind", kind, NO_DRAFTING)]


def without_drafting(cfg):
    """``cfg`` with no draft stage: what a profile's host section runs."""
    pipeline = {**cfg.pipeline, "draft": {"kind": "none"}}
    return cfg.model_copy(update={"draft": {"kind": "none"}, "pipeline": pipeline, "num_speculative_tokens": 0})
