"""Reading a Mooncake-format JSONL trace (``workload=trace``): one JSON object a line,
``timestamp`` (ms, optional: on every line or none), ``input_length``, ``output_length``,
``hash_ids``; into columns, once per file state in a process (validation and the run share
it), and a pipe (a process substitution) read once for every reader (``read_once``)."""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass
from typing import Any

import numpy as np

from pcpflow.errors import ConfigError, Problem

MAX_TRACE_LENGTH = 2**53
"""Largest length or hash id a trace line may give (exact in float64, far from int64's end)."""




def trace_problem(cfg: Any, what: str) -> ConfigError:
    return ConfigError([Problem(field="workload.path", given=cfg.path, allowed=what)])


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TRACE_LENGTH


_TRACE_FIELDS = ("input_length", "output_length", "hash_ids")


def _parse_trace_line(line: str) -> tuple[float | None, int, int, list[int]]:
    """(timestamp or None, input_length, output_length, hash_ids); ValueError says what is wrong."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(rec, dict):
        raise ValueError(f"expected a JSON object, got {type(rec).__name__}")
    missing = [k for k in _TRACE_FIELDS if k not in rec]
    if missing:
        raise ValueError(f"missing field(s) {missing}")
    ts = rec.get("timestamp")
    if ts is not None and (isinstance(ts, bool) or not isinstance(ts, (int, float)) or not ts >= 0 or math.isinf(ts)):
        raise ValueError(f"timestamp must be a number >= 0 (ms), got {ts!r}")
    for key in ("input_length", "output_length"):
        if not _is_count(rec[key]):
            raise ValueError(f"{key} must be an integer in [0, 2**53], got {rec[key]!r}")
    hash_ids = rec["hash_ids"]
    if not isinstance(hash_ids, list) or not all(_is_count(h) for h in hash_ids):
        raise ValueError(f"hash_ids must be a list of integers in [0, 2**53], got {_short(hash_ids)}")
    return (None if ts is None else float(ts)), rec["input_length"], rec["output_length"], hash_ids


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


@dataclass
class TraceColumns:
    timestamps: np.ndarray  # float64 ms, NaN where a line has none
    input_lens: np.ndarray
    output_lens: np.ndarray
    hash_ids: np.ndarray  # int64 flat
    hash_starts: np.ndarray  # int64 [N+1]


_READ: dict[tuple, TraceColumns] = {}


def _trace_key(cfg: Any) -> tuple:
    """What identifies one reading: the file as it is now, or (a pipe, a process
    substitution: it can be read once) its path."""
    try:
        st = os.stat(cfg.path)
    except OSError:
        return (cfg.path, cfg.skip, cfg.max_requests, None)
    ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) if stat.S_ISREG(st.st_mode) else "stream"
    return (cfg.path, cfg.skip, cfg.max_requests, ident)


def read_trace(cfg: Any) -> TraceColumns:
    """The trace's records, read once per file state in this process (validation and the
    run share it, and a pipe can be read only once)."""
    key = _trace_key(cfg)
    if key not in _READ:
        if len(_READ) > 8:
            _READ.clear()
        _READ[key] = _read_trace_file(cfg)
    return _READ[key]


def _read_trace_file(cfg: Any) -> TraceColumns:
    ts, inp, out, starts = [], [], [], [0]
    hash_parts: list[np.ndarray] = []
    seen = 0
    try:
        with open(cfg.path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                seen += 1
                if seen <= cfg.skip:
                    continue
                try:
                    t, i, o, h = _parse_trace_line(line)
                except ValueError as e:
                    raise trace_problem(
                        cfg, f"a well-formed trace; {cfg.path}:{lineno}: {e}"
                    ) from None
                if ts and (t is None) != math.isnan(ts[0]):
                    raise trace_problem(cfg, f"a timestamp on every line or on none; {cfg.path}:{lineno} "
                                         f"{'has none' if t is None else 'has one'}, the first request read "
                                         f"{'has one' if t is None else 'has none'}")
                ts.append(math.nan if t is None else t)
                inp.append(i)
                out.append(o)
                hash_parts.append(np.asarray(h, dtype=np.int64))
                starts.append(starts[-1] + len(h))
                if len(ts) == cfg.max_requests:
                    break
    except FileNotFoundError:
        raise trace_problem(
            cfg, f"an existing JSONL trace file; {cfg.path} does not exist"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise trace_problem(
            cfg, f"a readable JSONL trace file; reading {cfg.path} failed: {e}"
        ) from None
    if not ts:
        if seen and cfg.skip >= seen:  # NOTE: the skip is what went wrong, not the file
            raise ConfigError([Problem(field="workload.skip", given=cfg.skip,
                                       allowed=f"fewer than the trace's requests; {cfg.path} has {seen}")])
        raise trace_problem(cfg, f"a trace with requests; {cfg.path} has none")
    return TraceColumns(
        timestamps=np.asarray(ts, dtype=np.float64),
        input_lens=np.asarray(inp, dtype=np.int64),
        output_lens=np.asarray(out, dtype=np.int64),
        hash_ids=np.concatenate(hash_parts) if hash_parts else np.zeros(0, np.int64),
        hash_starts=np.asarray(starts, dtype=np.int64),
    )


_STREAMS: dict[str, str] = {}


def read_once(path: str) -> str:
    """A trace path that is not a regular file (a pipe: a process substitution ``<(...)``,
    which can be read once) as a regular file holding what it gave, the same one for every
    later reader in this process (validation, the run, an executed run's ranks); a regular
    file (or a path that does not exist: reported elsewhere) as it is."""
    path = os.path.abspath(os.path.expanduser(str(path)))
    if path in _STREAMS:
        return _STREAMS[path]
    try:
        if stat.S_ISREG(os.stat(path).st_mode) or stat.S_ISDIR(os.stat(path).st_mode):
            return path
        with open(path, "rb") as src:
            data = src.read()
    except OSError:
        return path
    import atexit
    import tempfile

    fd, copy = tempfile.mkstemp(prefix="pcpflow-trace-", suffix=".jsonl")
    with os.fdopen(fd, "wb") as dst:
        dst.write(data)
    atexit.register(lambda: os.path.exists(copy) and os.unlink(copy))
    _STREAMS[path] = copy
    return copy
