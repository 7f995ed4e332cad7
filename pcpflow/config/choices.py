"""How a problem names the values a setting allows, and the one a mistyped value was
probably meant to be: ``dtype: got 'bf16'; allowed: float32, float64, bfloat16 (did you mean
'bfloat16'?)``."""

from __future__ import annotations

import ast
import difflib
from collections.abc import Iterable
from typing import Any


def closest(given: Any, choices: Iterable[Any], *, cutoff: float = 0.6) -> str | None:
    """The choice closest to ``given`` (as text); None when none is close."""
    close = difflib.get_close_matches(str(given), [str(c) for c in choices], n=1, cutoff=cutoff)
    return close[0] if close else None


def did_you_mean(given: Any, choices: Iterable[Any], *, cutoff: float = 0.6) -> str:
    """`` (did you mean 'x'?)`` naming the choice closest to ``given``; '' when none is close."""
    close = closest(given, choices, cutoff=cutoff)
    return f" (did you mean {close!r}?)" if close else ""


def allowed_choices(given: Any, choices: Iterable[Any]) -> str:
    """``allowed: a, b, c`` as the user would type them (true, null), with the closest one."""
    words = [choice_word(c) for c in choices]
    return f"allowed: {', '.join(words)}{did_you_mean(given, words)}"


def choice_word(value: Any) -> str:
    """A choice as it is written on the command line or in YAML."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(getattr(value, "value", value))


def parse_expected(expected: str) -> list[Any] | None:
    """The values of pydantic's ``expected`` text (``"'a', 'b' or 'c'"``, or a union's tags
    ``"'a', 'b', 'c'"``); None when it is not a list of Python literals."""
    head, sep, last = expected.rpartition(" or ")
    text = f"{head}, {last}" if sep else expected
    try:
        values = ast.literal_eval(f"({text},)")
    except (ValueError, SyntaxError):
        return None
    return list(values) if isinstance(values, tuple) else None
