"""Per-step metrics (``metrics.jsonl``) and the run summary (``result.json`` ``metrics``).

Times come from a *run clock* that advances only by the pipeline and the scheduler, not
by verification, so TTFT/TPOT and tokens/s describe the layout under test even with
``verify=true``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Collection
from pathlib import Path
from typing import IO, Any

import numpy as np

FRAMEWORK_STAGES = ("validate", "plan", "buffers", "slots", "restore.indexing")
"""Pure bookkeeping (no model math, no collectives): whole stages, and the index
construction inside restore. A dotted name is a part of a stage's time (``stage.part``),
already counted in the stage's own total."""


EXECUTED_CLOCKS = {
    "run_s": "run clock: pipeline and scheduler time only (tokens/s, TTFT, TPOT)",
    "loop_s": "engine loop wall time on rank 0 (wall_s): the run clock plus verification",
    "job_s": "job wall time in the driver: validation, rank start-up, the run, results",
}
SIMULATED_CLOCKS = {
    "run_s": "simulated clock: the priced time of every step (tokens/s, TTFT, TPOT)",
    "loop_s": "the simulator's own wall time on this machine (wall_s)",
    "job_s": "job wall time in the driver: validation, the simulation, results",
}


STEP_COUNTS = ("prefix_hit_tokens", "prefix_query_tokens", "num_preempted")
"""The scheduler's ``StepStats`` that count what one ``schedule()`` did (the recorder sums
them over steps); the others are gauges of the state it left."""


def draft_record(outcome) -> dict[str, int]:
    """The drafting fields of a step record: drafts verified (``draft_proposed``), accepted,
    and the verify rows; empty for a step that verified none."""
    proposed = int(np.sum(outcome.num_proposed))
    if not proposed:
        return {}
    return {"draft_proposed": proposed, "draft_accepted": int(np.sum(outcome.num_accepted)),
            "draft_rows": int(np.count_nonzero(outcome.num_proposed))}  # draft_rows: verify rows


def step_record(batch: Any, layout: Any, *, attention_work: Any, calls: dict[str, int], nbytes: dict[str, int],
                step_s: float, generated: int, to_generate: int, stage_s: dict[str, float] | None = None,
                serving: Any = None, num_blocks: int = 0, time_s: float | None = None,
                window_attention_work: Any = None) -> dict[str, Any]:
    """The metrics.jsonl line of one step, as an executed and a simulated run both write it
    (each adds its own fields: verification, drafting and experts; prices). ``serving``:
    the scheduler's ``StepStats`` of the step (preemptions, prefix hits, KV blocks in use
    of ``num_blocks``, running and waiting requests); ``time_s``: the run clock at its start.
    ``attention_work``: the pairs each rank scores on one full-attention layer;
    ``window_attention_work``: on one windowed layer, sliding or chunked (a model with such layers only:
    ``per_rank_window_attention_work``)."""
    extra: dict[str, Any] = {}
    if serving is not None:
        extra = {
            "time_s": time_s,
            "num_running": serving.num_running,
            "num_waiting": serving.num_waiting,
            "kv_blocks_used": serving.kv_blocks_used,
            "kv_usage": serving.kv_blocks_used / num_blocks if num_blocks else 0.0,
            "prefix_hit_tokens": serving.prefix_hit_tokens,
            "prefix_query_tokens": serving.prefix_query_tokens,
            "num_preempted": serving.num_preempted,
        }
    window = {} if window_attention_work is None else {
        "per_rank_window_attention_work": np.asarray(window_attention_work).tolist()}
    return {
        "step": batch.step,
        "num_reqs": batch.num_reqs,
        "num_tokens": batch.num_tokens,
        "num_prefill_tokens": int(batch.num_scheduled_tokens[batch.is_prefilling].sum()),
        "per_rank_tokens": layout.per_rank_num_tokens.tolist(),
        "padded_num_tokens": layout.padded_num_tokens,
        "per_rank_attention_work": np.asarray(attention_work).tolist(),
        **window,
        "collective_calls": calls,
        "collective_bytes": nbytes,
        "stage_s": stage_s or {},
        "step_s": step_s,
        "num_generated": generated,
        "num_to_generate": to_generate,
        **extra,
    }


def pool_step_record(step: int, pools: dict[str, dict[str, Any] | None], *, pcp: dict[str, int],
                     num_blocks: dict[str, int], stats: dict[str, Any], transfer: dict[str, Any], queue: int,
                     step_s: float, time_s: float, generated: int, to_generate: int,
                     scheduled: Collection[str] | None = None) -> dict[str, Any]:
    """One step of a run with a prefill pool and a decode pool (``disagg=pd``): each pool's
    own record (``step_record``; None where the pool ran nothing) under ``pools``, the
    handover's ``transfer`` (the requests, their messages, bytes and seconds) and the
    ``handover_queue``, and the fields every run has, over both pools: per-rank lists are
    the prefill pool's PCP ranks, then the decode pool's; calls and bytes add up by purpose
    (``kv_transfer``: the handover's); serving counts, each pool's scheduler ``stats`` as of
    this step, add up (the queue counts as waiting). ``scheduled``: the pools whose
    ``schedule()`` made this step (None: both, a global step); only theirs count
    preemptions and prefix hits and queries, which the recorder sums over steps: another
    pool's ``stats`` are those of its own latest step, already counted there."""
    recs = [(name, pools.get(name)) for name in pcp]

    def total(key: str) -> int:
        return sum(r[key] for _, r in recs if r is not None)

    def by_purpose(key: str, extra: int) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for _, r in recs:
            for k, v in (r or {}).get(key, {}).items():
                out[k] += v
        if transfer.get("req_ids"):
            out["kv_transfer"] += extra
        return dict(out)

    def per_rank(key: str) -> list[int]:
        return [v for name, r in recs for v in (r[key] if r is not None else [0] * pcp[name])]

    stage_s: dict[str, float] = defaultdict(float)
    for _, r in recs:
        for k, v in (r or {}).get("stage_s", {}).items():
            stage_s[k] += v
    ranks = sum(pcp.values())
    window = "per_rank_window_attention_work"
    windowed = {window: per_rank(window)} if any(r is not None and window in r for _, r in recs) else {}
    serving = {k: sum(getattr(st, k) for st in stats.values()) for k in ("num_running", "num_waiting",
                                                                         "kv_blocks_used")}
    counted = [st for name, st in stats.items() if scheduled is None or name in scheduled]
    serving.update({k: sum(getattr(st, k) for st in counted) for k in STEP_COUNTS})
    serving["num_waiting"] += queue
    return {
        "step": step,
        "num_reqs": total("num_reqs"),
        "num_tokens": total("num_tokens"),
        "num_prefill_tokens": total("num_prefill_tokens"),
        "per_rank_tokens": per_rank("per_rank_tokens"),
        # NOTE: the mean over both pools' ranks, so that the padding fraction stays the share of padded rows
        "padded_num_tokens": sum(r["padded_num_tokens"] * pcp[n] for n, r in recs if r is not None) / ranks,
        "per_rank_attention_work": per_rank("per_rank_attention_work"),
        **windowed,
        "collective_calls": by_purpose("collective_calls", transfer.get("calls", 0)),
        "collective_bytes": by_purpose("collective_bytes", transfer.get("bytes", 0)),
        "stage_s": dict(stage_s),
        "step_s": step_s,
        "num_generated": generated,
        "num_to_generate": to_generate,
        "time_s": time_s,
        **serving,
        "kv_usage": serving["kv_blocks_used"] / sum(num_blocks.values()),
        "handover_queue": queue,
        "transfer": transfer,
        "pools": dict(recs),
    }


class MetricsRecorder:
    def __init__(self, path: Path | None, *, pcp_size: int, num_to_generate: int) -> None:
        self.file: IO[str] | None = open(path, "w") if path is not None else None  # noqa: SIM115
        self.pcp_size = pcp_size
        self.num_to_generate = num_to_generate
        self.num_steps = 0
        self.num_tokens = 0
        self.num_prefill_tokens = 0
        self.per_rank_tokens = np.zeros(pcp_size, dtype=np.int64)
        self.per_rank_padded_tokens = 0
        self.per_rank_attention_work = np.zeros(pcp_size, dtype=np.int64)
        self.per_rank_window_attention_work: np.ndarray | None = None  # a model with windowed (sliding or chunked) layers
        self.step_token_imbalance: list[float] = []
        self.stage_s: dict[str, float] = defaultdict(float)
        self.collective_calls: dict[str, int] = defaultdict(int)
        self.collective_bytes: dict[str, int] = defaultdict(int)
        self.run_s = 0.0
        self.draft_proposed = 0
        self.draft_accepted = 0
        self.draft_steps = 0
        self.draft_rows = 0
        self.kv_usage_s = 0.0  # sum of usage x step seconds (time-weighted mean)
        self.kv_usage_max = 0.0
        self.kv_usage_sum = 0.0
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0
        self.num_preempted = 0
        self.cp_attention_steps: dict[str, int] = defaultdict(int)
        self.per_rank_collective_bytes: dict[str, np.ndarray] = {}
        self.pools: dict[str, dict[str, float]] = {}  # disagg=pd: tokens, busy seconds, steps per pool
        self.transfer = {"bytes": 0, "calls": 0, "s": 0.0, "requests": 0}

    def step(self, record: dict[str, Any]) -> None:
        """Fold one step's record in and append it to metrics.jsonl."""
        self.num_steps += 1
        self.num_tokens += record["num_tokens"]
        self.num_prefill_tokens += record["num_prefill_tokens"]
        tokens = record["per_rank_tokens"]  # NOTE: a few ints: plain Python, not a numpy call each
        self.per_rank_tokens += tokens
        self.per_rank_padded_tokens += record["padded_num_tokens"]
        self.per_rank_attention_work += record["per_rank_attention_work"]
        if "per_rank_window_attention_work" in record:
            if self.per_rank_window_attention_work is None:
                self.per_rank_window_attention_work = np.zeros(self.pcp_size, dtype=np.int64)
            self.per_rank_window_attention_work += record["per_rank_window_attention_work"]
        total = sum(tokens)
        if total:
            self.step_token_imbalance.append(float(max(tokens) / (total / len(tokens))))
        for k, v in record["stage_s"].items():
            self.stage_s[k] += v
        for k, v in record["collective_calls"].items():
            self.collective_calls[k] += v
        for k, v in record["collective_bytes"].items():
            self.collective_bytes[k] += v
        self.run_s += record["step_s"]
        self.draft_proposed += record.get("draft_proposed", 0)
        self.draft_accepted += record.get("draft_accepted", 0)
        self.draft_steps += 1 if record.get("draft_proposed", 0) else 0
        self.draft_rows += record.get("draft_rows", 0)
        if "kv_usage" in record:
            self.kv_usage_s += record["kv_usage"] * record["step_s"]
            self.kv_usage_sum += record["kv_usage"]
            self.kv_usage_max = max(self.kv_usage_max, record["kv_usage"])
            self.prefix_hit_tokens += record["prefix_hit_tokens"]
            self.prefix_query_tokens += record["prefix_query_tokens"]
            self.num_preempted += record["num_preempted"]
        if "cp_attention" in record:
            self.cp_attention_steps[record["cp_attention"]] += 1
        for name, r in record.get("pools", {}).items():
            acc = self.pools.setdefault(name, {"tokens": 0, "busy_s": 0.0, "steps": 0})
            if r is not None:
                acc["tokens"] += r["num_tokens"]
                acc["busy_s"] += r["step_s"]
                acc["steps"] += 1
                if "cp_attention" in r:  # NOTE: each pool's batch of a step counts once
                    self.cp_attention_steps[r["cp_attention"]] += 1
        if record.get("transfer"):
            t = record["transfer"]
            self.transfer["bytes"] += t.get("bytes", 0)
            self.transfer["calls"] += t.get("calls", 0)
            self.transfer["s"] += t.get("s", 0.0)
            self.transfer["requests"] += len(t.get("req_ids", ()))
        for k, v in record.get("per_rank_collective_bytes", {}).items():
            self.per_rank_collective_bytes[k] = self.per_rank_collective_bytes.get(k, 0) + np.asarray(v, dtype=np.int64)
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def summary(self, requests: dict[str, np.ndarray], wall_s: float, *, simulated: bool = False,
                serving: dict[str, Any] | None = None) -> dict[str, Any]:
        """The run's metrics from its request columns (``pcpflow.scheduling.loop.request_columns``).
        ``simulated``: the run clock is the priced steps' time, the loop is the simulator's
        own, and no stage is timed (no framework overhead to report). ``serving``: what the
        serving metrics need (``serving_metrics``: prompt lengths, GPUs, SLOs)."""
        generated = int(np.sum(requests["output_len"]))
        stage_total = sum(v for k, v in self.stage_s.items() if "." not in k)
        framework = sum(v for k, v in self.stage_s.items() if k in FRAMEWORK_STAGES)
        out: dict[str, Any] = {
            "num_steps": self.num_steps,
            # NOTE: fewer finished than requests: the run was cut short (max_steps, an SLO watch)
            "num_requests": len(requests["req_id"]),
            "num_finished_requests": int(np.count_nonzero(requests["finish_step"] >= 0)),
            "num_tokens": self.num_tokens,
            "num_prefill_tokens": self.num_prefill_tokens,
            "num_generated_tokens": generated,
            "per_rank_tokens": self.per_rank_tokens.tolist(),
            "per_rank_attention_work": self.per_rank_attention_work.tolist(),
            "balance": {
                "tokens_max_over_mean": _max_over_mean(self.per_rank_tokens),
                "attention_work_max_over_mean": _max_over_mean(self.per_rank_attention_work),
                "mean_step_tokens_max_over_mean": float(np.mean(self.step_token_imbalance))
                if self.step_token_imbalance
                else 1.0,
                "padding_fraction": 1.0
                - self.per_rank_tokens.sum() / max(1, self.per_rank_padded_tokens * self.pcp_size),
            },
            "collective_bytes": dict(sorted(self.collective_bytes.items())),
            "collective_calls": dict(sorted(self.collective_calls.items())),
            # NOTE: a run cut short (max_steps) leaves requests without a first token.
            "ttft": _latency(requests["ttft_s"], requests["ttft_steps"]),
            "tpot": _latency(requests["tpot_s"], requests["tpot_steps"]),
            "run_s": self.run_s,
            "wall_s": wall_s,
            "clocks": {
                "run_s": self.run_s,
                "loop_s": wall_s,
                "meaning": SIMULATED_CLOCKS if simulated else EXECUTED_CLOCKS,
            },
            # NOTE: per second of the run clock (steps only), every scheduled token (prefills,
            # recomputed ones included); metrics.throughput counts requests over their span.
            "tokens_per_s": self.num_tokens / self.run_s if self.run_s else 0.0,
            "generated_tokens_per_s": generated / self.run_s if self.run_s else 0.0,
            "stage_s": dict(self.stage_s),
            "framework_overhead_s": None if simulated else framework,
            "framework_overhead_fraction": None if simulated else (framework / stage_total if stage_total else 0.0),
        }
        if self.per_rank_window_attention_work is not None:
            out["per_rank_window_attention_work"] = self.per_rank_window_attention_work.tolist()
        if serving is not None:
            out.update(self.serving_metrics(requests, **serving))
        if self.cp_attention_steps:
            out["cp_attention_steps"] = dict(sorted(self.cp_attention_steps.items()))
        if self.per_rank_collective_bytes:  # point-to-point purposes (rings): what each rank sent
            out["per_rank_collective_bytes"] = {k: v.tolist() for k, v in sorted(self.per_rank_collective_bytes.items())}
        if self.draft_proposed:
            out["acceptance_rate"] = self.draft_accepted / self.draft_proposed
            out["draft_proposed"] = self.draft_proposed
            out["draft_accepted"] = self.draft_accepted
            # NOTE: per verify row (one request's step, 0..k), not summed over the batch:
            # a batch total grows with the number of running requests.
            out["mean_accepted_per_step"] = self.draft_accepted / max(1, self.draft_rows)
            out["mean_acceptance_length"] = 1.0 + out["mean_accepted_per_step"]  # tokens per verify row
            out["draft_steps"] = self.draft_steps
            out["draft_verify_rows"] = self.draft_rows
            # Share of step time (the run clock: pipeline + scheduler), as reported.
            out["draft_time_fraction"] = self.stage_s.get("draft", 0.0) / self.run_s if self.run_s else 0.0
        return out

    def pool_metrics(self, clock_s: float, ranks: dict[str, int], transfer: str) -> dict[str, Any]:
        """``metrics.pools`` and ``metrics.transfer`` of a run with pools (``disagg=pd``): per
        pool the tokens it ran and its utilization, the share of the run's clock (``clock_s``:
        its last step's end) it was running a step; the handover's bytes, messages and seconds
        (executed: the slowest rank's, per request, summed; simulated: the exposed price)."""
        pools = {name: {"tokens": int(acc["tokens"]), "utilization": acc["busy_s"] / clock_s if clock_s else 0.0,
                        "busy_s": acc["busy_s"], "steps": int(acc["steps"]), "ranks": ranks[name]}
                 for name, acc in self.pools.items()}
        return {"pools": pools, "transfer": {**self.transfer, "mode": transfer}}

    def serving_metrics(self, requests: dict[str, np.ndarray], *, prompt_lens: np.ndarray, gpus: int,
                        ttft_slo_s: float | None = None, tpot_slo_s: float | None = None) -> dict[str, Any]:
        """What a service cares about: throughput over the requests' span (first arrival to
        last finish, idle time included, as ``vllm bench serve`` counts), KV usage, prefix
        hits, preemptions, queueing, and goodput under the SLOs."""
        done = ~np.isnan(requests["finish_s"])
        span = float(np.nanmax(requests["finish_s"]) - np.nanmin(requests["arrival_s"])) if done.any() else 0.0
        out_tokens = float(np.sum(requests["output_len"][done]))
        in_tokens = float(np.sum(np.asarray(prompt_lens)[requests["req_id"][done]]))

        def per_s(x: float) -> float:
            return x / span if span > 0 else 0.0

        good = done.copy()
        if ttft_slo_s is not None:
            good &= requests["ttft_s"] <= ttft_slo_s
        if tpot_slo_s is not None:  # NOTE: a one-token request has no TPOT: it meets the SLO
            good &= np.isnan(requests["tpot_s"]) | (requests["tpot_s"] <= tpot_slo_s)
        has_slo = ttft_slo_s is not None or tpot_slo_s is not None
        queue = requests["queue_s"][~np.isnan(requests["queue_s"])]
        return {
            "throughput": {
                "span_s": span,
                "requests_s": per_s(float(done.sum())),
                "output_tok_s": per_s(out_tokens),
                "output_tok_s_per_gpu": per_s(out_tokens) / gpus,
                "total_tok_s": per_s(in_tokens + out_tokens),
            },
            "kv_usage": {
                "mean": self.kv_usage_s / self.run_s if self.run_s else (self.kv_usage_sum / max(1, self.num_steps)),
                "max": self.kv_usage_max,
            },
            "prefix_cache": {
                "hit_rate": self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0,
                "hit_tokens": self.prefix_hit_tokens,
                "query_tokens": self.prefix_query_tokens,
            },
            "preemptions": self.num_preempted,
            "queue_s": float(queue.mean()) if len(queue) else None,
            "goodput": {
                "req_s": per_s(float(good.sum())) if has_slo else None,
                "share": float(good.sum() / done.sum()) if has_slo and done.any() else None,
                "slo": {"ttft_s": ttft_slo_s, "tpot_s": tpot_slo_s},
            },
        }


def _max_over_mean(x: np.ndarray) -> float:
    x = np.asarray(x, dtype=np.float64)
    return float(x.max() / x.mean()) if len(x) and x.mean() > 0 else 1.0


def _latency(seconds: np.ndarray, steps: np.ndarray) -> dict[str, float | None]:
    s = np.asarray(seconds, dtype=np.float64)
    s = s[~np.isnan(s)]
    st = np.asarray(steps, dtype=np.float64)
    st = st[~np.isnan(st)]
    if not len(s):
        return {"mean_s": None, "p50_s": None, "p90_s": None, "p99_s": None, "mean_steps": None}
    p50, p90, p99 = np.percentile(s, [50, 90, 99])
    return {
        "mean_s": float(s.mean()),
        "p50_s": float(p50),
        "p90_s": float(p90),
        "p99_s": float(p99),
        "mean_steps": float(st.mean()) if len(st) else None,
    }
