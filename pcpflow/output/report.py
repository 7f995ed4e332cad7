"""What a person sees: the progress bar, the summary table, the plots.

The progress bar lives in the driver and follows ``metrics.jsonl`` (rank 0 appends a
line per step), so rank processes never draw on the console.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as _RichProgress
from rich.table import Table


class _Console(Console):
    """Rich's console, whose broken pipe stays Python's error (rich's own ends the process with
    SystemExit(1)): the driver keeps a run's result and goes on quietly (``run_job``)."""

    def on_broken_pipe(self) -> None:
        raise  # NOTE: the BrokenPipeError rich is handling (the guarded stdout's ConsoleGone, errno kept)


_console = _Console(stderr=True)


class Progress:
    """Context manager: a bar of generated tokens while the ranks run (TTY only)."""

    def __init__(self, metrics_path: Path, enabled: bool = True, unit: str = "tokens") -> None:
        self.path, self.unit = metrics_path, unit
        self.enabled = enabled and _console.is_terminal
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Progress:
        if self.enabled:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def _run(self) -> None:
        columns = (
            TextColumn("[bold]pcpflow[/] step {task.fields[step]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(self.unit),
            TimeElapsedColumn(),
        )
        with _RichProgress(*columns, console=_console, transient=True) as bar:
            task = bar.add_task("run", total=None, step=0)
            offset = 0
            while not self._stop.wait(0.2):
                if not self.path.exists():
                    continue
                with open(self.path) as f:
                    f.seek(offset)
                    lines = f.readlines()
                    offset = f.tell()
                for line in lines:
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    bar.update(task, completed=rec["num_generated"], total=rec["num_to_generate"], step=rec["step"])


class Phases:
    """Context manager: a bar per phase of long work done in this process (a search's screen,
    its pricing in full, its fitted factors): what it is, how many of how many, how long.
    TTY only, as the run's bar."""

    def __init__(self, enabled: bool = True, console: Console | None = None) -> None:
        self.console = console or _console
        self.enabled = enabled and self.console.is_terminal
        self._bar: _RichProgress | None = None
        self._task: Any = None

    def __enter__(self) -> Phases:
        if self.enabled:
            self._bar = _RichProgress(TextColumn("[bold]pcpflow[/] {task.description}"), BarColumn(),
                                      MofNCompleteColumn(), TimeElapsedColumn(), console=self.console, transient=True)
            self._bar.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def phase(self, description: str, total: int | None) -> None:
        """A new bar (the previous one stays, complete or not)."""
        if self._bar is not None:
            self._task = self._bar.add_task(description, total=total)

    def advance(self, n: int = 1) -> None:
        if self._bar is not None and self._task is not None:
            self._bar.advance(self._task, n)


def _routing(v: dict) -> str:
    """The MoE routing part of the verification row (pcpflow.rank.routing): empty for a dense model."""
    if "num_routing_mismatches" not in v:
        return ""
    shown = f" · routing {'match' if v['routing_match'] else 'DIFFERS'}"
    ties = v["num_routing_near_ties"]
    return shown + (f" ({ties} near-tie(s): the run's experts)" if ties else "")


def _breakdown(breakdown: dict[str, dict[str, float]], top: int = 5) -> str:
    """The largest exposed terms of a simulated run, with their share (and what hid)."""
    total = sum(v["exposed_s"] for v in breakdown.values()) or 1.0
    ranked = sorted(breakdown.items(), key=lambda kv: -kv[1]["exposed_s"])[:top]
    return " · ".join(f"{k} {v['exposed_s']:.3g} s ({v['exposed_s'] / total:.0%})"
                      + (f" +{v['hidden_s']:.2g} s hidden" if v["hidden_s"] else "") for k, v in ranked)


def _requests(m: dict[str, Any], rows: list[dict[str, Any]] | None) -> str:
    """How many requests ran and how long they were (what a workload's defaults made of it)."""
    text = f"{m['num_requests']:,}"
    if rows:
        prompt = [r["prompt_len"] for r in rows]
        output = [r["output_len"] for r in rows]
        text += (f" · prompts mean {sum(prompt) / len(prompt):,.0f} tokens (max {max(prompt):,})"
                 f" · outputs mean {sum(output) / len(output):,.0f} (max {max(output):,})")
    return text


def print_summary(result: dict[str, Any]) -> None:
    cfg, m = result["config"], result.get("metrics", {})
    console = _Console()
    title = f"pcpflow  {config_title(cfg)}"
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("metric", style="bold")
    table.add_column("value")
    status = result["status"]
    table.add_row("status", f"[green]{status}[/]" if status == "ok" else f"[red]{status}[/]")
    if "num_requests" in m and m["num_finished_requests"] < m["num_requests"]:
        table.add_row("cut short", f"[yellow]{m['num_finished_requests']} of {m['num_requests']} requests finished[/]"
                      + (f" (max_steps={cfg.get('max_steps')})" if cfg.get("max_steps") else ""))
    if result.get("verification"):  # mode=simulate
        table.add_row("verification", str(result["verification"]))
    prof = result.get("profile")
    if prof:  # mode=profile
        peaks = " · ".join(f"{k} {v:.3g}" for k, v in (prof.get("peak_tflops") or {}).items() if v)
        table.add_row("profile", f"{prof['status']} · {', '.join(prof['dtypes'])} · {prof['elapsed_s']:.0f} s measuring")
        table.add_row("measured", f"GEMM peaks (TFLOP/s) {peaks} · memory {prof.get('hbm_tbps') or 0:.3g} TB/s · "
                                  f"an op {prof.get('launch_us') or 0:.3g} us")
        table.add_row("hardware profile", f"{prof['path']}  (mode=simulate hardware=measured hardware.path=...)")
    sim = m.get("simulate") if m else None
    if sim:
        experts = sim.get("expert_weights_dtype")  # the routed experts' where they differ (gpt-oss: mxfp4)
        mixed = f" (experts {experts})" if experts not in (None, sim["weights_dtype"]) else ""
        table.add_row(
            "simulated on",
            f"{sim['hardware']} · {sim['gpus']} {'CPU ranks' if sim.get('device') == 'cpu' else 'GPUs'} "
            f"({sim['nodes']} nodes) · tp={cfg['tp']} · weights {sim['weights_dtype']}{mixed}"
            f" · KV {sim.get('kv_dtype', 'bf16')} · {sim['tflops_per_gpu']:.0f} TF/s per GPU",
        )
        if sim.get("breakdown_s"):
            table.add_row("where the time goes", _breakdown(sim["breakdown_s"]))
    v = result.get("verify")
    if v:
        table.add_row(
            "exact vs 1 rank",
            f"tokens {'match' if v['tokens_match'] else 'DIFFER'} · KV {'match' if v['kv_match'] else 'DIFFERS'} · "
            + (f"drafter KV {'match' if v['draft_kv_match'] else 'DIFFERS'} · " if "draft_kv_match" in v else "")
            + f"max |Δlogit| {v['max_abs_logit_diff']:.2e} (tol {v['tolerance']:g})"
            + (f" · {len(v['near_ties'])} token near-tie(s)" if v["near_ties"] else "")
            + _routing(v)
            + "".join(f"\n{line}" for line in v.get("failures", ())),
        )
    if m:
        if "num_requests" in m:
            table.add_row("requests", _requests(m, result.get("requests")))
        table.add_row("steps / tokens", f"{m['num_steps']} steps · {m['num_tokens']} tokens · {m['num_generated_tokens']} generated")
        clock = "simulated clock" if sim else "run clock"
        table.add_row("throughput", f"{m['tokens_per_s']:.0f} tokens/s on the {clock}")
        table.add_row("clocks", _clocks(m))
        ttft, tpot = m["ttft"], m["tpot"]
        if ttft["mean_s"] is not None:
            table.add_row("TTFT", f"mean {ttft['mean_s'] * 1e3:.1f} ms · p90 {ttft['p90_s'] * 1e3:.1f} ms · "
                          f"p99 {ttft['p99_s'] * 1e3:.1f} ms · {ttft['mean_steps']:.1f} steps")
        if tpot["mean_s"] is not None:
            steps = f" · {tpot['mean_steps']:.2f} steps" if tpot["mean_steps"] is not None else ""
            table.add_row("TPOT", f"mean {tpot['mean_s'] * 1e3:.1f} ms · p99 {tpot['p99_s'] * 1e3:.1f} ms{steps}")
        if m.get("pools"):
            table.add_row("pools", pools_row(m))
        for label, shown in serving_rows(m):
            table.add_row(label, shown)
        b = m["balance"]
        table.add_row(
            "balance (max/mean)",
            f"tokens {b['tokens_max_over_mean']:.3f} · attention work {b['attention_work_max_over_mean']:.3f} · "
            f"padding {b['padding_fraction']:.1%}",
        )
        if m["collective_bytes"]:
            table.add_row(
                "collective bytes",
                " · ".join(f"{k} {human_bytes(v)} ({m['collective_calls'][k]} calls)" for k, v in m["collective_bytes"].items()),
            )
        if m.get("framework_overhead_s") is not None:
            table.add_row("framework overhead", f"{m['framework_overhead_s'] * 1e3:.1f} ms ({m['framework_overhead_fraction']:.1%} of stage time)")
        if "acceptance_rate" in m:
            table.add_row(
                "speculative",
                f"acceptance {m['acceptance_rate']:.1%} · {m['mean_accepted_per_step']:.2f} accepted/step · "
                f"draft {m['draft_time_fraction']:.1%} of step time" + _random_head_note(cfg),
            )
    for label, shown in first_outputs(result):
        table.add_row(label, shown)
    console.print(table)
    # NOTE: outside the table, unstyled: a path cut to the terminal's width ("…") is no path.
    print(f"results: {Path(result['run_dir']) / 'result.json'}", flush=True)


def serving_rows(m: dict[str, Any]) -> list[tuple[str, str]]:
    """The summary's serving lines: throughput over the requests' span, KV cache, goodput."""
    t = m.get("throughput")
    if not t:
        return []
    rows = [("served", f"{t['requests_s']:.2f} req/s · {t['output_tok_s']:,.0f} output tok/s "
                       f"({t['output_tok_s_per_gpu']:,.0f} per GPU) · {t['total_tok_s']:,.0f} total tok/s over "
                       f"{t['span_s']:.2f} s (first arrival to last finish)")]
    queue, groups = m.get("queue_s"), m.get("kv_groups")
    rows.append(("KV cache", f"usage mean {m['kv_usage']['mean']:.1%} · max {m['kv_usage']['max']:.1%} · "
                             f"prefix hits {m['prefix_cache']['hit_rate']:.1%} of prompt tokens · "
                             f"{m['preemptions']} preemption(s)"
                 + (f" · queued {queue * 1e3:.1f} ms on average" if queue is not None else "")
                 + (f" · {groups['groups']} KV groups ({groups['windowed']} windowed, {groups['layers_per_block']} "
                    f"layer(s) a block)" if groups else "")))
    g = m.get("goodput") or {}
    if g.get("req_s") is not None:
        slo = " and ".join(f"{k.split('_')[0].upper()} <= {v * 1e3:.0f} ms" for k, v in g["slo"].items() if v is not None)
        share = ("no request finished" if g["share"] is None  # NOTE: a run cut short (max_steps)
                 else f"{g['share']:.1%} of finished requests meet {slo}")
        rows.append(("goodput", f"{g['req_s']:.2f} req/s · {share}"))
    return rows


def _random_head_note(cfg: dict[str, Any]) -> str:
    """Why the shipped drafters accept next to nothing: their heads are seeded random weights,
    a faithful mechanism rather than a trained drafter (``draft=self`` accepts partially)."""
    kind = (cfg.get("draft") or {}).get("kind")
    if cfg.get("mode") == "simulate":  # NOTE: its acceptance is the one it was given (simulate.draft_acceptance)
        given = (cfg.get("simulate") or {}).get("draft_acceptance")
        return f" · acceptance drawn from simulate.draft_acceptance={given}" if given else " · acceptance drawn from error_rate"
    if kind in ("mtp", "dspark"):
        return (f" · the {kind} head is random weights (not trained), so ~0% acceptance is expected; "
                "draft=self draft.error_rate=0.2 shows partial acceptance")
    return ""


# --- text out
SHOWN_OUTPUTS = 3
SHOWN_CHARS = 200


def first_outputs(result: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, shown) rows for the first requests' outputs: their text where the
    checkpoint has a tokenizer, else their token ids, cut to one readable line."""
    from rich.markup import escape

    texts, outputs = result.get("texts"), result.get("outputs") or []
    rows = []
    for i, ids in enumerate(outputs[:SHOWN_OUTPUTS]):
        shown = repr(texts[i]) if texts is not None else str(ids)
        if len(shown) > SHOWN_CHARS:
            shown = shown[: SHOWN_CHARS - 3] + "..."
        rows.append((f"output {i}", escape(f"{shown} ({len(ids)} tokens)")))
    if len(outputs) > SHOWN_OUTPUTS:
        rows.append(("", f"... {len(outputs) - SHOWN_OUTPUTS} more in result.json"))
    return rows
# --- end text out
def _clocks(m: dict[str, Any]) -> str:
    c = m.get("clocks") or {}
    if m.get("simulate"):
        parts = [f"simulated {m['run_s']:.3f} s (the priced steps: what tokens/s, TTFT, TPOT use)",
                 f"simulator {m['wall_s']:.2f} s on this machine"]
    else:
        parts = [f"run clock {m['run_s']:.2f} s (pipeline + scheduler: what tokens/s, TTFT, TPOT use)",
                 f"engine loop {m['wall_s']:.2f} s (+ verification)"]
    if c.get("job_s") is not None:
        parts.append(f"job {c['job_s']:.2f} s (+ validation, {'' if m.get('simulate') else 'rank start-up, '}results)")
    return " · ".join(parts)


def human_bytes(n: float) -> str:
    """A byte count as people read it: 512 B, 3.0 MiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def pools_row(m: dict[str, Any]) -> str:
    """The summary's line on the pools (``disagg=pd``): each pool's ranks, tokens and
    utilization, and what the handovers moved."""
    pools = " · ".join(f"{name} {p['ranks']} rank(s), {p['tokens']:,} tokens, busy {p['utilization']:.0%}"
                       for name, p in m["pools"].items())
    t = m["transfer"]
    return (f"{pools} · handed over {t['requests']} request(s): {human_bytes(t['bytes'])} in {t['calls']} "
            f"message(s) ({t['mode']}), {t['s'] * 1e3:.1f} ms")


def config_title(cfg: dict[str, Any]) -> str:
    """The settings that tell runs apart, in one line (the summary's and load.png's title)."""
    parts = [f"pcp={cfg.get('pcp')} dcp={cfg.get('dcp')}"]
    if cfg.get("tp", 1) != 1:
        parts[0] += f" tp={cfg['tp']}"
    disagg = cfg.get("disagg") or {}
    if disagg.get("kind") == "pd":
        d = disagg["decode_pool"]
        parts[0] += f" -> decode pool tp={d['tp']} pcp={d['pcp']} dcp={d['dcp']} interleave={d['interleave']}"
    decode = cfg.get("decode") or {}
    parts.append(f"decode={decode.get('mode')}/{decode.get('assignment')}")
    parts.append(f"model={(cfg.get('model') or {}).get('name')}")
    workload = (cfg.get("workload") or {}).get("kind")
    if workload:
        parts.append(f"workload={workload}")
    draft = (cfg.get("draft") or {}).get("kind", "none")
    if draft != "none":
        parts.append(f"draft={draft}")
    parts.append(str(cfg.get("dtype")))
    return "  ".join(parts)


_STYLES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def write_plots(run_dir: Path) -> dict[str, Any] | None:
    """``load.png``: tokens and attention work per rank over the steps, and how uneven
    each step is (max/mean over ranks). Each rank has its own colour, line style and
    marker, so that ranks on top of each other (an even step) stay visible; steps with
    prefill tokens are shaded. Returns what it drew (title, per-rank series, the prefill
    steps) for tests."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    result_path = run_dir / "result.json"
    cfg = json.loads(result_path.read_text()).get("config") or {} if result_path.exists() else {}
    steps = np.array([r["step"] for r in records])
    tokens = np.array([r["per_rank_tokens"] for r in records], dtype=float)
    work = np.array([r["per_rank_attention_work"] for r in records], dtype=float)
    prefill = np.array([r.get("num_prefill_tokens", 0) > 0 for r in records])
    fig, axes = plt.subplots(3, 1, figsize=(9, 7.5), sharex=True, height_ratios=(3, 3, 2))
    for ax, data, label in ((axes[0], tokens, "tokens"), (axes[1], work, "attention work (q·k pairs)")):
        for rank in range(data.shape[1]):
            ax.plot(
                steps, data[:, rank], lw=1.2, ls=_STYLES[rank % len(_STYLES)],
                marker=_MARKERS[rank % len(_MARKERS)], ms=3, markevery=max(1, len(steps) // 25),
                label=f"rank {rank}",
            )
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    for data, label, color in ((tokens, "tokens", "tab:green"), (work, "attention work", "tab:orange")):
        mean = data.mean(axis=1)
        ratio = np.divide(data.max(axis=1), mean, out=np.ones_like(mean), where=mean > 0)
        axes[2].plot(steps, ratio, lw=1.2, color=color, label=label)
    axes[2].axhline(1.0, color="grey", lw=0.8, ls="--")
    axes[2].set_ylabel("max/mean over ranks")
    axes[2].grid(alpha=0.3)
    axes[2].set_xlabel("step")
    # Prefill phases (steps with prompt tokens) shaded; the rest are decode-only steps.
    for lo, hi in _runs(steps, prefill):
        for ax in axes:
            ax.axvspan(lo - 0.5, hi + 0.5, color="tab:blue", alpha=0.08, lw=0)
    from matplotlib.patches import Patch

    handles, labels = axes[0].get_legend_handles_labels()
    handles.append(Patch(color="tab:blue", alpha=0.15))
    labels.append("steps with prefill (unshaded: decode only)")
    axes[0].legend(handles, labels, ncol=min(4, len(labels)), fontsize=8)
    axes[2].legend(fontsize=8)
    title = f"per-rank load per step: {config_title(cfg)}" if cfg else "per-rank load per step"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(run_dir / "load.png", dpi=110)
    plt.close(fig)
    return {"title": title, "ranks": tokens.shape[1], "prefill_steps": steps[prefill].tolist(),
            "styles": [line.get_linestyle() for line in axes[0].get_lines()]}


def _runs(steps, mask) -> list[tuple[int, int]]:
    """(first, last) step of each run of consecutive steps where ``mask`` holds."""
    import numpy as np

    idx = np.flatnonzero(mask)
    if not idx.size:
        return []
    breaks = np.flatnonzero(np.diff(idx) > 1)
    starts = np.r_[idx[0], idx[breaks + 1]]
    ends = np.r_[idx[breaks], idx[-1]]
    return [(int(steps[a]), int(steps[b])) for a, b in zip(starts, ends)]
