"""One job: validate everything, start the ranks, write ``result.json``.

Validation happens entirely before any rank starts: the run config (pydantic +
cross-field rules), every stage's config (after importing plugins), and the workload
(trace readable, every request fits the KV cache). Problems are reported together,
exit code 2.
"""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path
from typing import Any

from pcpflow import __version__
from pcpflow.config import RunConfig, validate_run_config
from pcpflow.errors import EXIT_FAILED, EXIT_INVALID_CONFIG, EXIT_OK, ConfigError, Problem
from pcpflow.kv_cache import KVCacheManager
from pcpflow.launch import RESULT_FILE, RankFailure, launch_ranks, print_err, write_frozen_config
from pcpflow.pipeline import num_speculative_tokens, resolve_pipeline
from pcpflow.scheduler import check_fits
from pcpflow.workload import build_requests


def prepare_job(raw: dict[str, Any]) -> RunConfig:
    """The validated config of one job; raises ConfigError with every problem found."""
    cfg, problems = validate_run_config(raw)
    if cfg is None:
        raise ConfigError(problems)
    try:
        k = num_speculative_tokens(resolve_pipeline(cfg))
        if "num_speculative_tokens" in raw and raw["num_speculative_tokens"] != k:
            problems.append(Problem("num_speculative_tokens", raw["num_speculative_tokens"],
                                    f"derived from the draft stage ({k}); set draft.num_speculative_tokens"))
        cfg = cfg.model_copy(update={"num_speculative_tokens": k})
    except ConfigError as exc:
        problems += exc.problems
    try:
        requests = build_requests(cfg.workload, vocab_size=model_vocab_size(cfg), seed=cfg.seed)
        kv = KVCacheManager(cfg.kv.num_blocks, cfg.kv.block_size, cfg.dcp)
        problems += check_fits(requests, kv, cfg.num_speculative_tokens)
    except ConfigError as exc:
        problems += exc.problems
    if problems:
        raise ConfigError(problems)
    return cfg


def model_vocab_size(cfg: RunConfig) -> int:
    from pcpflow.models import vocab_size_of

    return vocab_size_of(cfg.model)


def run_job(raw: dict[str, Any], run_dir: Path, *, console: bool = True) -> int:
    """Validate, launch, record. Returns the exit code (0 ok, 1 failed, 2 invalid)."""
    from pcpflow.report import Progress, print_summary, write_plots

    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    try:
        cfg = prepare_job(raw)
    except ConfigError as exc:
        print_err(exc.report())
        write_result(run_dir, {"status": "failed", "error": exc.report(), "config": raw, "exit_code": 2})
        return EXIT_INVALID_CONFIG
    write_frozen_config(cfg, run_dir)
    config = cfg.model_dump(mode="json")
    try:
        with Progress(run_dir / "metrics.jsonl", enabled=console and cfg.output.progress):
            sections = launch_ranks(cfg, run_dir)
    except RankFailure as exc:
        print_err(f"pcpflow: {exc}")
        if exc.details:
            print_err(exc.details.rstrip())
        write_result(run_dir, {"status": "failed", "error": str(exc), "config": config, "exit_code": 1})
        return EXIT_FAILED
    except Exception as exc:  # the in-process single rank
        print_err(f"pcpflow: rank 0 failed: {type(exc).__name__}: {exc}")
        print_err(traceback.format_exc().rstrip())
        write_result(
            run_dir,
            {"status": "failed", "error": f"rank 0 failed: {type(exc).__name__}: {exc}", "config": config, "exit_code": 1},
        )
        return EXIT_FAILED
    verify = sections.get("verify")
    ok = verify is None or verify["passed"]
    clocks = (sections.get("metrics") or {}).get("clocks")
    if clocks is not None:
        clocks["job_s"] = time.time() - started
    result = {
        "status": "ok" if ok else "failed",
        "error": None if ok else "verification against the single-rank reference failed",
        "exit_code": EXIT_OK if ok else EXIT_FAILED,
        "config": config,
        **sections,
        "run_dir": str(run_dir),
        "started_at": started,
        "pcpflow_version": __version__,
    }
    write_result(run_dir, result)
    if cfg.output.plots:
        write_plots(run_dir)
    if console:
        print_summary(result)
    return result["exit_code"]


def write_result(run_dir: Path, result: dict[str, Any]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    result.setdefault("error", None)
    (run_dir / RESULT_FILE).write_text(json.dumps(result, indent=2, default=_jsonable) + "\n")


def _jsonable(obj: Any) -> Any:
    import numpy as np

    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")
