"""Configuration problems: collected, reported once, exit code 2."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
