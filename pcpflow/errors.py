"""Configuration problems: collected, reported once, exit code 2; and ``Settings``, the base
of every config model: unknown keys refused, values frozen, numbers finite and never a
boolean (YAML's ``true`` is not ``1``: ``pcp=true`` is a mistake, not one rank). A field that
means something by ``inf`` says so itself (``Field(allow_inf_nan=True)``)."""

from __future__ import annotations

import functools
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INVALID_CONFIG = 2


@dataclass(frozen=True)
class Problem:
    """One invalid setting: where it is, what was given, what is allowed."""

    field: str
    given: Any
    allowed: str

    def __str__(self) -> str:
        given = "<missing>" if self.given is _MISSING else repr(self.given)
        return f"{self.field}: got {given}; {self.allowed}"


_MISSING = object()
MISSING = _MISSING


class ConfigError(Exception):
    """Raised with every problem found, so that the user fixes them in one pass."""

    def __init__(self, problems: list[Problem], header: str = "invalid configuration") -> None:
        self.problems = list(problems)
        self.header = header
        super().__init__(self.report())

    def report(self) -> str:
        lines = [f"pcpflow: {self.header} ({len(self.problems)} problem(s)):"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


def missing_extra(modules: tuple[str, ...], extra: str) -> str | None:
    """None when every module imports; else one line naming those missing and the extra of
    pcpflow's that brings them."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return f"{' and '.join(missing)} not installed: install pcpflow's {extra!r} extra (pip install -e '.[{extra}]' in a checkout, pip install 'pcpflow[{extra}]' otherwise)"


# ------------------------------------------------------------------------ config models
def _takes_bool(annotation: Any) -> bool:
    """Whether a field of this type may hold a boolean (bool, Any, a Literal of one, or a
    union or container of such)."""
    if annotation is bool or annotation is Any:
        return True
    if typing.get_origin(annotation) is typing.Literal:
        return any(isinstance(v, bool) for v in typing.get_args(annotation))
    return any(_takes_bool(a) for a in typing.get_args(annotation))


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_boolean_numbers(cls, data: Any) -> Any:
        """A boolean given to a field that takes none reaches it as the word the user typed
        (``true``), which the field's own check refuses, naming what it takes."""
        if not isinstance(data, dict):
            return data
        bad = [k for k, v in data.items() if isinstance(v, bool) and k in cls.model_fields and not _field_takes_bool(cls, k)]
        return {**data, **{k: str(data[k]).lower() for k in bad}} if bad else data


@functools.cache
def _field_takes_bool(cls: type[BaseModel], name: str) -> bool:
    return _takes_bool(cls.model_fields[name].annotation)
