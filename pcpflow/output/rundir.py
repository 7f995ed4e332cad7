"""The files of one run dir: the frozen ``config.json``, ``result.json``, and the lock that
keeps two live runs out of one dir.

Ground floor: the driver (``pcpflow.driver.job``) and the ranks (``pcpflow.rank.bootstrap``) both write
here, and neither imports the other.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
RESULT_FILE = "result.json"
METRICS_FILE = "metrics.jsonl"
LOCK_FILE = ".pcpflow.lock"


def dumps(obj: Any) -> str:
    """Strict JSON of a run's dict (what every JSON reader takes): numpy values as Python
    ones, and a float that is not finite, which JSON has no number for, as the string Python
    and pydantic read back (``workload.request_rate=inf``: ``"inf"``)."""
    return json.dumps(_strict(obj), indent=2, allow_nan=False, default=_jsonable)


def _numpy_types() -> tuple[type, ...]:
    """numpy's array and scalar types where numpy is loaded (a value of numpy's exists only
    then). NOTE: not imported here: a signal that interrupted numpy's own import leaves it
    unloadable in this process ("cannot load module more than once"), and result.json must
    still be written."""
    np = sys.modules.get("numpy")
    return (np.ndarray, np.generic) if hasattr(np, "ndarray") and hasattr(np, "generic") else ()


def _strict(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if isinstance(obj, dict):
        return {k: _strict(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_strict(v) for v in obj]
    if isinstance(obj, _numpy_types()):
        return _strict(obj.tolist())
    return obj


def write_frozen_config(cfg: Any, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CONFIG_FILE).write_text(dumps(cfg.model_dump(mode="json")) + "\n")


def load_frozen_config(run_dir: Path) -> Any:
    from pcpflow.config.run import parse_run_config

    return parse_run_config(json.loads((run_dir / CONFIG_FILE).read_text()))


def write_result(run_dir: Path, result: dict[str, Any]) -> None:
    """Write ``result.json`` atomically: a reader (a sweep report, a second rank) never sees
    half of it, and a crash mid-write leaves the previous file whole."""
    run_dir.mkdir(parents=True, exist_ok=True)
    result.setdefault("error", None)
    tmp = run_dir / f".{RESULT_FILE}.{os.getpid()}.tmp"
    try:
        tmp.write_text(dumps(result) + "\n")
        os.replace(tmp, run_dir / RESULT_FILE)
    except BaseException:  # a full disk, or a signal mid-write: no half file left behind either
        try:
            tmp.unlink()
        except OSError:
            pass
        raise


def result_of(sections: dict[str, Any], config: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """``result.json`` of a run whose ranks finished: ok unless verification failed."""
    from pcpflow.errors import EXIT_FAILED, EXIT_OK

    verify = sections.get("verify")
    ok = verify is None or verify["passed"]
    return {
        "status": "ok" if ok else "failed",
        "error": None if ok else "verification against the single-rank reference failed"
                 + "".join(f": {line}" for line in (verify or {}).get("failures", ())[:1]),
        "exit_code": EXIT_OK if ok else EXIT_FAILED,
        "config": config,
        **sections,
        **extra,
    }


def failed_result(error: str, config: dict[str, Any], exit_code: int, **extra: Any) -> dict[str, Any]:
    return {"status": "failed", "error": error, "exit_code": exit_code, "config": config, **extra}


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, _numpy_types()):
        return obj.tolist()  # NOTE: a numpy scalar's is its Python value
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


# ------------------------------------------------------------------------------ lock
def live_lock_owner(run_dir: Path) -> int | None:
    """The pid of a live run that holds ``run_dir`` (None: free, or its owner is gone)."""
    try:
        pid = int((run_dir / LOCK_FILE).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if pid == os.getpid():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return pid
    return pid


def take_lock(run_dir: Path) -> None:
    (run_dir / LOCK_FILE).write_text(f"{os.getpid()} {' '.join(sys.argv)}\n")


PREVIOUS_RESULT_FILE = "result.previous.json"


def write_refusal(run_dir: Path, result: dict[str, Any]) -> None:
    """``result.json`` of a command refused as invalid (exit 2), or interrupted before its run
    started, in a dir that may hold an older run's: that one is kept as ``result.previous.json``
    (a typo loses nothing), and the refusal is what ``result.json`` says (an old "ok" never
    looks current). A refusal replaces an earlier one of its kind, never the result kept aside."""
    current = run_dir / RESULT_FILE
    try:
        earlier = json.loads(current.read_text())
    except (OSError, ValueError):
        earlier = None
    if isinstance(earlier, dict) and earlier.get("exit_code") != result.get("exit_code"):
        os.replace(current, run_dir / PREVIOUS_RESULT_FILE)
    write_result(run_dir, result)


def discard_result(run_dir: Path) -> None:
    """Removes an older run's ``result.json`` and ``metrics.jsonl`` as a new run, validated,
    starts in its dir.

    NOTE: the new run rewrites config.json at once; a run killed outright (SIGKILL, the OOM
    killer, a power cut) cannot write its own result, and the older one's "ok" beside the new
    config would say that this run succeeded. No result.json says it did not finish; the
    steps in metrics.jsonl are this run's (``progress_of``)."""
    for name in (RESULT_FILE, METRICS_FILE):
        try:
            (run_dir / name).unlink()
        except FileNotFoundError:
            pass


def progress_of(run_dir: Path) -> dict[str, Any]:
    """``{"progress": ...}`` of a run that did not finish, from the last line of its
    ``metrics.jsonl`` (read from the end: the file may be large): the last step it ran and the
    tokens generated of those to generate (``last_step`` null: no step ran)."""
    last: dict[str, Any] = {}
    try:
        with open(run_dir / METRICS_FILE, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - (1 << 20)))
            for line in reversed(f.read().splitlines()):
                try:
                    last = json.loads(line)
                    break
                except ValueError:  # the line a crash cut short
                    continue
    except OSError:
        pass
    if not isinstance(last, dict):
        last = {}
    return {"progress": {"last_step": last.get("step"), "num_generated": last.get("num_generated", 0),
                         "num_to_generate": last.get("num_to_generate")}}


def release_lock(run_dir: Path) -> None:
    path = run_dir / LOCK_FILE
    try:
        if int(path.read_text().split()[0]) == os.getpid():
            path.unlink()
    except (OSError, ValueError, IndexError):
        pass


def release_lock_of_dead(run_dir: Path) -> None:
    """Removes the lock of a run whose process is gone (never a live one's)."""
    path = run_dir / LOCK_FILE
    if path.exists() and live_lock_owner(run_dir) is None:
        try:
            path.unlink()
        except OSError:
            pass
