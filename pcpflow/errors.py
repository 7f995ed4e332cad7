"""Configuration problems: collected, reported once, exit code 2; and ``Settings``, the base
of every config model: unknown keys refused, values frozen, numbers finite and never a
boolean (YAML's ``true`` is not ``1``: ``pcp=true`` is a mistake, not one rank), booleans
true or false only (nor is ``1`` true, nor ``yes``). A field that means something by ``inf``
says so itself (``Field(allow_inf_nan=True)``)."""

from __future__ import annotations

import functools
import types
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    ModelWrapValidatorHandler,
    ValidationError,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError
from pydantic_core.core_schema import ErrorType

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

    @model_validator(mode="wrap")
    @classmethod
    def _true_or_false(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        """A boolean field takes true or false only: pydantic would take 'yes', 'on' or 1 for one,
        where any other word is told that it takes true or false (the words themselves, quoted
        into strings, are still those two). The other fields are judged all the same, so that
        every problem is said at once."""
        bad = {k: data[k] for k in _bool_fields(cls) if k in data and not _true_or_false_word(data[k])
               } if isinstance(data, dict) else {}
        if not bad:
            return handler(data)
        errors = [InitErrorDetails(type="bool_type", loc=(k,), input=v) for k, v in bad.items()]
        try:  # NOTE: without them, which then take their defaults (or are missing: said already)
            handler({k: v for k, v in data.items() if k not in bad})
        except ValidationError as exc:
            errors += [_again(e) for e in exc.errors() if not (e["loc"] and e["loc"][0] in bad)]
        raise ValidationError.from_exception_data(cls.__name__, errors)


_PYDANTIC_ERRORS = frozenset(typing.get_args(ErrorType))


def _again(e: Any) -> InitErrorDetails:
    """One of ``ValidationError.errors()`` to raise again: pydantic's own types by name, a
    custom one (a plugin's ``PydanticCustomError``) as its type and message."""
    if e["type"] in _PYDANTIC_ERRORS:
        return InitErrorDetails(type=e["type"], loc=e["loc"], input=e["input"], ctx=e.get("ctx", {}))
    return InitErrorDetails(type=PydanticCustomError(e["type"], e["msg"]), loc=e["loc"], input=e["input"])


@functools.cache
def _field_takes_bool(cls: type[BaseModel], name: str) -> bool:
    return _takes_bool(cls.model_fields[name].annotation)


def _true_or_false_word(v: Any) -> bool:
    return v is None or isinstance(v, bool) or (isinstance(v, str) and v.lower() in ("true", "false"))


@functools.cache
def _bool_fields(cls: type[BaseModel]) -> tuple[str, ...]:
    """The fields of type bool, or bool | None."""
    def boolean(annotation: Any) -> bool:
        return annotation is bool or (typing.get_origin(annotation) in (typing.Union, types.UnionType)
                                      and set(typing.get_args(annotation)) == {bool, type(None)})

    return tuple(name for name, f in cls.model_fields.items() if boolean(f.annotation))
