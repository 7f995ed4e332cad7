"""The stage protocol and the stage registry.

A stage is a class with a nested pydantic ``Config`` (whose ``kind`` names it) and one
method, ``__call__(state) -> state``, run once per step on every rank::

    @register
    class MyDraft(Stage):
        kind = "my_draft"
        slots = ("draft",)

        class Config(StageConfig):
            kind: Literal["my_draft"] = "my_draft"
            num_speculative_tokens: int = Field(2, ge=1, description="tokens proposed per step")

        def __call__(self, state: StepState) -> StepState:
            ...
            return state

The registry fills from the built-in stages (``pcpflow.pipeline.assemble`` loads them: the protocol
names no stage), the ``pcpflow.stages`` entry-point group, and the run's ``plugins`` list;
a config may also name a class directly as ``"pkg.module:Class"``. Registration is
idempotent: every rank imports the same plugins.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import Field

from pcpflow.config.choices import did_you_mean
from pcpflow.errors import Problem, Settings

if TYPE_CHECKING:
    import torch

    from pcpflow.models.base import AttentionSpec
    from pcpflow.pipeline.context import RankContext
    from pcpflow.pipeline.state import StepState

SLOTS = ("validate", "plan", "buffers", "slots", "forward", "restore", "draft")
"""The pipeline's named slots, in the order they run."""

ENTRY_POINT_GROUP = "pcpflow.stages"


class StageConfig(Settings):
    """Base of every stage's nested ``Config``."""

    kind: str = Field(description="registered stage kind, or 'pkg.module:Class'")


class Stage:
    """Base class of pipeline stages."""

    kind: ClassVar[str]
    slots: ClassVar[tuple[str, ...] | None] = None
    """Slots this stage may fill; None means any slot (and extra positions)."""
    Config: ClassVar[type[StageConfig]] = StageConfig

    def __init__(self, config: StageConfig, ctx: RankContext) -> None:
        self.config = config
        self.ctx = ctx

    def __call__(self, state: StepState) -> StepState:  # pragma: no cover - protocol
        raise NotImplementedError

    def own_kv(self) -> list[tuple[AttentionSpec, list[torch.Tensor]]]:
        """Paged KV caches this stage keeps of a request's tokens besides the target's (a
        drafter's own cache, on the target's block tables and slot rule): ``(the spec of the
        whole, unsharded cache, its per-layer caches)`` each. A handover between pools
        (``disagg=pd``) moves their entries of the prompt along with the target's, and
        ``verify=true`` checks them against the single-rank reference's as it checks the
        target's (a drafter may write scratch only at the ``num_speculative_tokens`` slots
        from the newest token on). A stage that keeps such a cache and does not list it here
        would decode from a cache that was never filled."""
        return []

    @classmethod
    def check_run(cls, config: StageConfig, run: Any) -> list[Any]:
        """Cross-field checks against the whole run config, done in the driver before any
        rank starts. Returns a list of ``pcpflow.errors.Problem``; empty when fine."""
        return []


class UnknownStageError(LookupError):
    """A kind that no registered stage (or importable class) answers to."""


_REGISTRY: dict[str, type[Stage]] = {}
_IMPORTED: set[str] = set()
_SOURCES_LOADED = False


def register(cls: type[Stage]) -> type[Stage]:
    """Class decorator: add a stage under its ``kind``. Re-registering the same class
    (a module imported twice, or by every rank) is a no-op."""
    if not (inspect.isclass(cls) and issubclass(cls, Stage)):
        raise TypeError(f"@register expects a Stage subclass, got {cls!r}")
    kind = getattr(cls, "kind", None)
    if not isinstance(kind, str) or not kind:
        raise TypeError(f"stage {cls.__qualname__} must define a non-empty class attribute 'kind'")
    existing = _REGISTRY.get(kind)
    if existing is not None and _qualname(existing) != _qualname(cls):
        raise ValueError(
            f"stage kind {kind!r} is registered twice: {_qualname(existing)} and {_qualname(cls)}"
        )
    _REGISTRY[kind] = cls
    return cls


def _qualname(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def import_plugins(modules: list[str] | tuple[str, ...]) -> None:
    """Import user plugin modules (their ``@register`` calls fill the registry).
    Idempotent; raises ``ModuleNotFoundError``/``ImportError`` with the module name."""
    for name in modules:
        if name in _IMPORTED:
            continue
        importlib.import_module(name)
        _IMPORTED.add(name)


def load_stage_sources(plugins: list[str] | tuple[str, ...] = ()) -> None:
    """Fill the registry from outside pcpflow: the entry-point group, then ``plugins``
    (``pcpflow.pipeline.assemble.load_stages`` adds the built-in stages first)."""
    global _SOURCES_LOADED
    if not _SOURCES_LOADED:
        load_entry_points()
        _SOURCES_LOADED = True
    import_plugins(plugins)


def load_entry_points() -> list[str]:
    """Load the ``pcpflow.stages`` entry points of installed distributions: each names a
    Stage class (registered here) or a module (whose ``@register`` calls run on import).
    Returns the entry point names loaded."""
    names = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        loaded = ep.load()
        if inspect.isclass(loaded) and issubclass(loaded, Stage):
            register(loaded)
        names.append(ep.name)
    return names


def known_kinds(slot: str | None = None) -> list[str]:
    """Registered kinds, optionally only those that may fill ``slot``."""
    return sorted(
        kind
        for kind, cls in _REGISTRY.items()
        if slot is None or cls.slots is None or slot in cls.slots
    )


def resolve(kind: str, slot: str | None = None) -> type[Stage]:
    """The stage class for ``kind`` (a registered kind or ``'pkg.module:Class'``)."""
    if ":" in kind:
        module_name, _, attr = kind.partition(":")
        try:
            obj: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            raise UnknownStageError(f"cannot import stage {kind!r}: {exc}") from None
        if not (inspect.isclass(obj) and issubclass(obj, Stage)):
            raise UnknownStageError(f"{kind!r} is not a pcpflow Stage subclass")
        return register(obj)
    cls = _REGISTRY.get(kind)
    if cls is None:
        raise UnknownStageError(unknown_kind_message(kind, slot))
    if slot is not None and cls.slots is not None and slot not in cls.slots:
        raise UnknownStageError(
            f"stage kind {kind!r} cannot fill slot {slot!r} (it fills {', '.join(cls.slots)}); "
            f"known kinds for {slot!r}: {', '.join(known_kinds(slot))}"
        )
    return cls


def unknown_kind_message(kind: str, slot: str | None) -> str:
    """``slot`` None: a stage for any position (``pipeline.extra``), which the kinds that fill
    a slot are not."""
    known = known_kinds(slot)
    hint = did_you_mean(kind, known)
    if slot is None:
        anywhere = [k for k in known if _REGISTRY[k].slots is None]
        listed = (f"kinds for any position: {', '.join(anywhere)}" if anywhere
                  else "no registered kind goes in any position (pcpflow's own each fill a slot)")
    else:
        listed = f"known kinds: {', '.join(known)}"
    where = f" for slot {slot!r}" if slot else ""
    return f"unknown stage kind {kind!r}{where}{hint}; {listed} (or 'pkg.module:Class'; add modules with plugins=[...])"


def build_config(kind_cls: type[Stage], raw: dict[str, Any]) -> StageConfig:
    """Validate a slot's raw config dict against the stage's own ``Config``. A
    ``'module:Class'`` kind is replaced by the class's registered kind first."""
    data = dict(raw)
    data["kind"] = kind_cls.kind
    return kind_cls.Config.model_validate(data)


def plugin_problems(plugins: list[str]) -> list[Problem]:
    """Each plugin module imports: any error it raises at import (a SyntaxError, a
    NameError, an ImportError of its own) is its problem, named with the module."""
    problems = []
    for i, name in enumerate(plugins):
        try:
            import_plugins([name])
        except ModuleNotFoundError as exc:
            if exc.name and name.startswith(exc.name):
                problems.append(Problem(f"plugins[{i}]", name, "an importable module (it is not on sys.path / PYTHONPATH)"))
            else:
                problems.append(Problem(f"plugins[{i}]", name, f"a module that imports; importing it failed: {_short(exc)}"))
        except SystemExit as exc:  # NOTE: else the driver would exit with the plugin's code, silently
            problems.append(Problem(f"plugins[{i}]", name, f"a module that imports; importing it called sys.exit({exc.code!r})"))
        except Exception as exc:  # noqa: BLE001 - a user module may raise anything at import
            problems.append(Problem(f"plugins[{i}]", name, f"a module that imports; importing it failed: {_short(exc)}"))
    return problems


def _short(exc: BaseException) -> str:
    if isinstance(exc, SyntaxError):
        return f"SyntaxError: {exc.msg} ({exc.filename}, line {exc.lineno})"
    return f"{type(exc).__name__}: {exc}"
