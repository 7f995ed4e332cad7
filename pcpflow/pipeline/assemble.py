"""Assemble a pipeline from the run config: one stage per slot, plus user extras.

``pipeline.<slot>`` names each slot's stage (``{kind: ..., <its settings>}``); the draft
slot takes the ``draft`` group with ``pipeline.draft`` on top. ``pipeline.extra`` adds
user stages at a position: ``[{kind: my_pkg.probes:Probe, after: forward}, ...]``.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from pcpflow.config.choices import allowed_choices
from pcpflow.config.run import pydantic_problems
from pcpflow.errors import MISSING, ConfigError, Problem
from pcpflow.paths import conf_dir
from pcpflow.pipeline.stage import (
    SLOTS,
    Stage,
    StageConfig,
    UnknownStageError,
    build_config,
    known_kinds,
    load_stage_sources,
    resolve,
)
from pcpflow.pipeline.state import StepState

if TYPE_CHECKING:
    from pcpflow.config.run import RunConfig
    from pcpflow.pipeline.context import RankContext

TARGET_SLOTS = tuple(s for s in SLOTS if s != "draft")
"""The slots that compute the target model's step (the reference runs only these)."""

BUILTIN_STAGES = (
    "pcpflow.stages.validate",
    "pcpflow.stages.plan",
    "pcpflow.stages.buffers",
    "pcpflow.stages.slots",
    "pcpflow.stages.forward",
    "pcpflow.stages.restore",
    "pcpflow.stages.draft_none",
    "pcpflow.stages.mtp",
    "pcpflow.stages.dspark",
    "pcpflow.stages.self_draft",
)
"""The modules of the built-in stages (the folder ``stages/``, installed as ``pcpflow.stages``)."""


def load_builtin_stages() -> None:
    """Register the built-in stages (idempotent): before any plugin, so that a plugin taking
    a built-in kind fails at its own import, as its problem."""
    for name in BUILTIN_STAGES:
        importlib.import_module(name)


def is_builtin(cls: type[Stage]) -> bool:
    """One of pcpflow's own stages (``stages/``), not a plugin's or an entry point's."""
    return cls.__module__ in BUILTIN_STAGES


def builtin_kinds(slot: str) -> list[str]:
    """The kinds pcpflow's own stages offer for ``slot``."""
    load_builtin_stages()
    return [k for k in known_kinds(slot) if is_builtin(resolve(k))]


def load_stages(plugins: list[str] | tuple[str, ...] = ()) -> None:
    """Fill the registry: the built-in stages, the entry-point group, then ``plugins``.
    Idempotent (every rank calls it); a plugin that cannot be imported raises ImportError."""
    load_builtin_stages()
    load_stage_sources(plugins)


def num_speculative_tokens(specs: list[StageSpec]) -> int:
    """Drafts per request and step of an assembled pipeline: its draft stage's
    ``num_speculative_tokens`` (a plugin drafter's own default when not set); 0 without one."""
    draft = next((s for s in specs if s.name == "draft"), None)
    if draft is None or draft.cls.kind == "none":
        return 0
    k = getattr(draft.config, "num_speculative_tokens", 0)
    return k if isinstance(k, int) and not isinstance(k, bool) else 0


DRAFT_TOKENS_KEYS = ("num_speculative_tokens", "draft.num_speculative_tokens", "pipeline.draft.num_speculative_tokens")
"""Where a command line may try to set the drafts per step."""


def draft_tokens_override(raw: dict[str, Any], value: Any) -> str | None:
    """The override that sets the draft stage's ``num_speculative_tokens`` to ``value`` in this
    composed config: the draft group's key where the group's option is the stage (draft=mtp),
    else ``pipeline.draft``'s (a plugin drafter, or a slot swapped with pipeline.draft.kind),
    which the draft group does not have. None: the stage has no such setting."""
    group, slot = raw.get("draft") or {}, (raw.get("pipeline") or {}).get("draft") or {}
    kind = slot.get("kind") or group.get("kind")
    if kind == group.get("kind") and "num_speculative_tokens" in group:
        return f"draft.num_speculative_tokens={value}"
    try:
        load_stages(raw.get("plugins") or ())
        cls = resolve(str(kind), "draft")
    except (Exception, SystemExit):  # noqa: BLE001 - a plugin that does not import is its own problem
        return None
    if "num_speculative_tokens" not in cls.Config.model_fields:
        return None
    return f"{'' if 'num_speculative_tokens' in slot else '+'}pipeline.draft.num_speculative_tokens={value}"


@dataclass(frozen=True)
class StageSpec:
    name: str  # the slot, or "extra[i]:<kind>" for an inserted stage
    cls: type[Stage]
    config: StageConfig


def resolve_pipeline(cfg: RunConfig) -> list[StageSpec]:
    """Every stage, in run order; raises ConfigError naming each bad field."""
    problems: list[Problem] = []
    try:
        load_stages(cfg.plugins)
    except ImportError as exc:
        name = getattr(exc, "name", None) or str(exc)
        problems.append(Problem("plugins", cfg.plugins, f"cannot import {name!r}: {exc}"))
        raise ConfigError(problems) from None

    raw = cfg.pipeline
    for key in raw:
        if key not in (*SLOTS, "extra"):
            problems.append(Problem(f"pipeline.{key}", raw[key], f"unknown slot; slots: {', '.join(SLOTS)}, extra"))
    specs: list[StageSpec] = []
    for slot in SLOTS:
        if slot == "draft":
            found: list[Problem] = []
            spec = _stage(slot, cfg.draft_stage_config(), "draft", cfg, found)
            problems += [_named_where_set(p, raw.get("draft") or {}, cfg.draft) for p in found]
        else:
            spec = _stage(slot, raw.get(slot), f"pipeline.{slot}", cfg, problems)
        if spec is not None:
            specs.append(spec)

    for i, item in enumerate(raw.get("extra") or []):
        where = f"pipeline.extra[{i}]"
        if not isinstance(item, dict):
            problems.append(Problem(where, item, "a mapping {kind: ..., after|before: <slot>}"))
            continue
        item = dict(item)
        anchors = {k: item.pop(k) for k in ("after", "before") if k in item}
        # NOTE: the position, the kind and the settings are judged together: every problem of the entry at once
        placed = _position(anchors, where, problems)
        spec = _stage(None, item, where, cfg, problems)
        if spec is not None and spec.cls.slots is not None:  # NOTE: it would run a second time beside its own slot's
            slots = spec.cls.slots
            problems.append(Problem(f"{where}.kind", item["kind"], f"a stage for any position; {spec.cls.kind!r} fills only "
                                    f"the {'/'.join(slots)} slot: pipeline.{slots[0]}.kind={item['kind']}"))
            spec = None
        pos = next((j for j, s in enumerate(specs) if placed and s.name == placed[1]), None)
        if spec is None or placed is None or pos is None:  # an anchor slot in error is its own problem
            continue
        spec = StageSpec(f"extra[{i}]:{spec.cls.kind}", spec.cls, spec.config)
        specs.insert(pos + (placed[0] == "after"), spec)
    k = num_speculative_tokens(specs)
    if k and k + 1 > cfg.scheduler.max_num_batched_tokens:
        problems.append(
            Problem(
                "scheduler.max_num_batched_tokens",
                cfg.scheduler.max_num_batched_tokens,
                f"must hold a verify row of 1 + {k} speculative tokens",
            )
        )
    if problems:
        raise ConfigError(problems)
    return specs


def _named_where_set(p: Problem, slot: dict[str, Any], group: dict[str, Any]) -> Problem:
    """A draft stage setting given under ``pipeline.draft`` (on top of the draft group) is named
    there: a plugin drafter's settings have no key in the draft group to set instead."""
    key = p.field.removeprefix("draft.").split(".")[0]
    if p.field.startswith("draft.") and slot.get(key) is not None and slot.get(key) != group.get(key):
        return Problem(f"pipeline.{p.field}", p.given, p.allowed)
    return p


def _position(anchors: dict[str, Any], where: str, problems: list[Problem]) -> tuple[str, str] | None:
    """An extra stage's ``(side, slot)``: exactly one of after/before, naming a slot."""
    if len(anchors) != 1:
        problems.append(Problem(where, anchors or MISSING, f"exactly one of after/before, naming a slot: {', '.join(SLOTS)}"))
        return None
    (side, anchor), = anchors.items()
    if anchor not in SLOTS:
        problems.append(Problem(f"{where}.{side}", anchor, allowed_choices(anchor, SLOTS)))
        return None
    return side, anchor


def _stage(slot: str | None, raw: Any, where: str, cfg: RunConfig, problems: list[Problem]) -> StageSpec | None:
    if not isinstance(raw, dict) or not raw.get("kind"):
        problems.append(Problem(f"{where}.kind", raw.get("kind", MISSING) if isinstance(raw, dict) else raw, "a stage kind is required"))
        return None
    try:
        cls = resolve(str(raw["kind"]), slot)
    except UnknownStageError as exc:
        problems.append(Problem(f"{where}.kind", raw["kind"], str(exc)))
        return None
    if slot is not None:
        raw = _without_unset_defaults_of_other_stages(slot, cls, raw)
    try:
        config = build_config(cls, raw)
    except ValidationError as exc:
        problems.extend(pydantic_problems(exc, prefix=where, model=cls.Config))
        return None
    problems.extend(cls.check_run(config, cfg))
    return StageSpec(slot or where, cls, config)


def _without_unset_defaults_of_other_stages(slot: str, cls: type[Stage], raw: dict[str, Any]) -> dict[str, Any]:
    """A slot swapped to another stage must not inherit the shipped stage's options.

    ``conf/pipeline/default.yaml`` lists the built-in stages' options (so that, e.g.,
    ``pipeline.forward.dcp_rest=context`` works without a ``+``). When
    ``pipeline.forward.kind=my_forward`` swaps the stage, options the new stage does not
    know and the user left at their shipped value are dropped; anything the user did set
    still reaches the new stage's validation (and fails there if it is unknown)."""
    shipped = _shipped_pipeline().get(slot) or {}
    known = cls.Config.model_fields
    return {
        k: v for k, v in raw.items() if k in known or k not in shipped or shipped[k] != v
    }


_SHIPPED: dict[str, Any] | None = None


def _shipped_pipeline() -> dict[str, Any]:
    global _SHIPPED
    if _SHIPPED is None:
        from omegaconf import OmegaConf

        node = OmegaConf.load(f"{conf_dir()}/pipeline/default.yaml")
        _SHIPPED = OmegaConf.to_container(node, resolve=False)  # type: ignore[assignment]
    return _SHIPPED


class Pipeline:
    """The instantiated stages of one rank; calling it runs one step. ``on_stage(name)`` is
    told each stage as it starts (the rank's progress board: where a failure happened)."""

    def __init__(self, specs: list[StageSpec], ctx: RankContext, on_stage: Callable[[str], None] | None = None) -> None:
        self.stages = [(spec.name, spec.cls(spec.config, ctx)) for spec in specs]
        self.on_stage = on_stage
        # NOTE: published once for whoever moves or checks them (handover, verification, faults)
        ctx.own_kv.update({name: own for name, stage in self.stages if (own := stage.own_kv())})

    def __call__(self, state: StepState) -> StepState:
        for name, stage in self.stages:
            if self.on_stage is not None:
                self.on_stage(name)
            t0 = time.perf_counter()
            out = stage(state)
            if not isinstance(out, StepState):
                raise TypeError(f"stage {name} ({type(stage).__module__}.{type(stage).__qualname__}) returned "
                                f"{type(out).__name__}: a stage returns the step state it was given (or a new one)")
            state = out
            state.timings[name] = time.perf_counter() - t0
        return state

    def stage(self, name: str) -> Stage:
        return dict(self.stages)[name]


def stage_problems(cfg: RunConfig, raw: dict[str, Any]) -> tuple[list[Problem], RunConfig]:
    """The pipeline's problems, and ``cfg`` with ``num_speculative_tokens`` taken from its
    draft stage (the scheduler must reserve exactly what the stage will propose)."""
    try:
        k = num_speculative_tokens(resolve_pipeline(cfg))
    except ConfigError as exc:
        return exc.problems, cfg
    given = raw.get("num_speculative_tokens")
    if given is not None and given != k:
        override = draft_tokens_override(raw, given)
        fix = f"set it with {override}" if override else "choose a drafter that proposes tokens (draft=mtp|dspark|self)"
        return [Problem("num_speculative_tokens", given, f"derived from the draft stage ({k}); {fix}")], cfg
    return [], cfg.model_copy(update={"num_speculative_tokens": k})
