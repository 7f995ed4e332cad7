"""The pre-run check layer: everything the driver can find wrong before a rank starts,
gathered from the features that know their own limits.

``check_job(cfg, kind=...)`` raises one ConfigError listing every problem (exit code 2):
the plugins and the stages (``pcpflow.pipeline``), the checkpoint (``pcpflow.models.hf``:
safetensors headers against config.json), the workload from its lengths alone
(``pcpflow.scheduling``: no token array is built to find out that it is too big, and the
one "can this request ever fit" rule of the KV cache), and for an executed run, which
allocates on this host, the host's memory (``pcpflow.rank.devices``); for every run, a
checkpoint's limits against the longest request (``pcpflow.models.hf.length_problems``:
executed, LongRoPE's original length). A simulated run (``mode=simulate``) reads only config.json and
sizes its KV cache from the hardware it prices, so host-memory limits are skipped there.

``feature_problems`` are the features' rules on the config itself (run beside its
cross-field rules); ``check_run_dir`` and ``capacity_warnings`` are the driver's checks of
where and how the ranks will run.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from pcpflow.config.disagg import POOLS, keep_align, pool_config, pool_problems
from pcpflow.errors import ConfigError, Problem


def check_job(cfg: Any, raw: dict[str, Any] | None = None, *, kind: str | None = None) -> Any:
    """Every pre-run check; returns ``cfg`` with the fields derived from its stages
    (``num_speculative_tokens``), raises ConfigError listing every problem."""
    from pcpflow.driver.launch import launch_problems
    from pcpflow.models.hf import checkpoint_problems, length_problems
    from pcpflow.pipeline.assemble import load_builtin_stages, stage_problems
    from pcpflow.pipeline.stage import plugin_problems
    from pcpflow.profile.checks import shipped_stage_problems, without_drafting
    from pcpflow.rank.devices import host_memory_problems
    from pcpflow.scheduling.kv_cache import fit_problems

    kind = kind or getattr(cfg, "mode", "execute")
    load_builtin_stages()
    imported = plugin_problems(cfg.plugins)
    # NOTE: once the plugins are imported, so that a kind of theirs is known as theirs
    refused = shipped_stage_problems(cfg) if kind == "profile" else []
    # NOTE: plugins refused as a whole (mode=profile): why one would not import is moot
    problems = [p for p in imported if not _about_refused(p.field, refused)] + refused
    if not imported:  # the stages import the plugins: only once they import cleanly
        # NOTE: a refused drafter's settings, and what they would ask of the scheduler, are moot
        found, cfg = stage_problems(without_drafting(cfg) if _about_refused("draft", refused) else cfg, raw or {})
        found = [p for p in found if not _about_refused(p.field, refused)]  # a refused stage's settings are moot
        problems += found
        if cfg.disagg.enabled and not cfg.disagg.decode_grid.problems():  # the decode pool's own stage rules
            more, _ = stage_problems(pool_config(cfg, "decode"), raw or {})
            problems += pool_problems(cfg, [p for p in more if p not in found and not _about_refused(p.field, refused)],
                                      "decode")
    if kind == "execute":
        problems += launch_problems(cfg)
    checkpoint = checkpoint_problems(cfg.model)
    problems += checkpoint
    if not checkpoint:  # NOTE: a bad stage or seed must not hide a workload that cannot fit
        lengths = _request_lengths(cfg, problems)
        if lengths is not None:
            groups = run_groups(cfg)
            for pool in POOLS if cfg.disagg.enabled else ("prefill",):
                c = pool_config(cfg, pool)
                # NOTE: a prefill pool holds prompts only; the decode pool, prompts and every output
                outputs = lengths[1] * 0 if cfg.disagg.enabled and pool == "prefill" else lengths[1]
                # NOTE: a prefill pool's window groups keep the decode pool's whole entries (pool_schedulers)
                align = keep_align(cfg) if pool == "prefill" else None
                problems += pool_problems(cfg, fit_problems(lengths[0], outputs, num_speculative_tokens=cfg.num_speculative_tokens,
                                                            block_size=c.kv.block_size, dcp_size=c.dcp,
                                                            num_blocks=c.kv.num_blocks, groups=groups,
                                                            max_num_batched_tokens=c.scheduler.max_num_batched_tokens,
                                                            keep_align=align),
                                                pool)
            if kind == "execute":
                problems += host_memory_problems(cfg, *lengths, specs=None if imported else _resolved(cfg))
            if len(lengths[0]):  # NOTE: simulated too: it prices the whole-sequence attention pcpflow runs
                longest = int((lengths[0] + lengths[1]).max()) + cfg.num_speculative_tokens
                problems += length_problems(cfg.model, longest)
    if problems:
        raise ConfigError(problems)
    return cfg


def run_groups(cfg: Any):
    """The KV groups the run's cache will have (``pcpflow.scheduling.kv_groups``), counted from
    the model's config (a checkpoint's config.json: its windowed layers as the loader reads
    them); None with one group, or where the model's config does not read (its problems are
    named elsewhere)."""
    from pcpflow.simulate.prepare import sizes_kv_groups

    if cfg.kv.hybrid == "off":
        return None
    sizes = _sizes(cfg)
    return None if sizes is None else sizes_kv_groups(cfg.kv.hybrid, sizes, drafting=cfg.draft_enabled)


def _sizes(cfg: Any):
    """The model's sizes (``pcpflow.simulate.sizes``; a checkpoint's from its config.json), or
    None where its config does not read."""
    from pcpflow.models.card import ModelCard, card_from_hf_config
    from pcpflow.simulate.sizes import model_sizes

    model = cfg.model
    try:
        if getattr(model, "name", None) == "hf":
            model = ModelCard(**card_from_hf_config(model.path))
        return model_sizes(model)
    except (ValueError, TypeError, OSError):
        return None


def _resolved(cfg: Any) -> list | None:
    """The pipeline's stages; None where it does not resolve (its problems are named)."""
    from pcpflow.pipeline.assemble import resolve_pipeline

    try:
        return resolve_pipeline(cfg)
    except ConfigError:
        return None


def _about_refused(field: str, refused: list[Problem]) -> bool:
    """``field`` is a setting of what is already refused as a whole (``pipeline.<slot>.kind``,
    ``pipeline.extra``, ``plugins``, ``draft``; the draft slot's settings are named ``draft.*``
    or ``pipeline.draft.*``)."""
    for p in refused:
        stage = p.field.removesuffix(".kind")
        owners = ("draft", "pipeline.draft") if stage in ("draft", "pipeline.draft") else (stage,)
        if any(field == o or field.startswith((f"{o}.", f"{o}[")) for o in owners):
            return True
    return False


def _request_lengths(cfg: Any, problems: list[Problem]):
    """(prompt_lens, output_lens) of the workload, or None with its problems added. The
    number of requests is checked against the host's memory before any is built."""
    from pcpflow.models import vocab_size_of
    from pcpflow.scheduling.workload import request_lengths
    from pcpflow.simulate.prepare import requests_of, workload_host_problems

    try:
        if getattr(cfg, "mode", "execute") == "simulate":
            table = requests_of(cfg.workload, vocab_size_of(cfg.model), cfg.seed)
            return table.prompt_lens, table.output_lens
        too_many = workload_host_problems(cfg.workload)
        if too_many:
            raise ConfigError(too_many)
        return request_lengths(cfg.workload, seed=cfg.seed, vocab_size=vocab_size_of(cfg.model))
    except ConfigError as exc:
        problems += [p for p in exc.problems if p not in problems]
        return None


def feature_problems(cfg: Any) -> list[Problem]:
    """The rules each feature knows of its own limits (tensor parallel splits, devices, CUDA
    graphs, experts, what a simulation can price, what a profile can measure), beside the
    config's cross-field rules."""
    from pcpflow.models import ModelCard
    from pcpflow.parallel.moe_config import moe_problems
    from pcpflow.parallel.tensor_parallel import run_tp_problems
    from pcpflow.profile.checks import profile_problems
    from pcpflow.rank.cudagraph import cudagraph_problems
    from pcpflow.rank.devices import device_problems

    p = [] if cfg.grid.problems() else pool_problems(cfg, run_tp_problems(cfg), "prefill")
    p += device_problems(cfg) + cudagraph_problems(cfg) + pool_problems(cfg, moe_problems(cfg), "prefill")
    p += profile_problems(cfg)
    p += hybrid_problems(cfg)
    if cfg.disagg.enabled and not cfg.disagg.decode_grid.problems():  # heads the decode pool's tp splits, its experts
        decode = pool_config(cfg, "decode")
        p += pool_problems(cfg, run_tp_problems(decode) + moe_problems(decode), "decode")
    if cfg.mode == "simulate" or isinstance(cfg.model, ModelCard):
        from pcpflow.simulate.prepare import simulate_problems

        p += simulate_problems(cfg)
    return p


def hybrid_problems(cfg: Any) -> list[Problem]:
    """``kv.hybrid=on`` with what keeps every block (``pcpflow.scheduling.kv_groups``): a
    drafter beside windowed layers only."""
    if cfg.kv.hybrid != "on":
        return []
    sizes = _sizes(cfg) if cfg.draft_enabled else None
    if sizes is not None and sizes.window is not None and sizes.sliding_layers == sizes.num_layers:
        return [Problem("kv.hybrid", "on", "a drafter's caches go by a full layer's table, and every layer of this "
                        "model is windowed: use kv.hybrid=auto (falls back to one group) or off")]
    return []


def check_run_dir(run_dir: Path, *, create: bool = True, field: str = "hydra.run.dir") -> None:
    """The run dir is a directory this process can create and write (``create=False``:
    could create, without creating it: nothing may appear for an invalid command).
    ``field``: the setting that names it (a sweep's is ``hydra.sweep.dir``)."""
    problem = None
    if run_dir.exists() and not run_dir.is_dir():
        problem = "a directory; it is an existing file"
    elif not create:
        parent = next(p for p in (run_dir, *run_dir.parents) if p.exists())
        if not parent.is_dir():
            problem = f"a directory pcpflow can create; {parent} is a file"
        elif not os.access(parent, os.W_OK | os.X_OK):
            problem = f"a directory pcpflow can create; {parent} is not writable"
        else:  # NOTE: root passes os.access everywhere, also in /proc and /sys: try, leaving nothing
            try:
                os.rmdir(tempfile.mkdtemp(prefix=".pcpflow-probe-", dir=parent))
            except OSError as exc:
                problem = f"a directory pcpflow can create; {parent}: {exc.strerror or exc}"
    else:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            probe = run_dir / f".pcpflow-write-probe-{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as exc:
            problem = f"a directory pcpflow can create and write; {exc.strerror or exc}"
    if problem:
        raise ConfigError([Problem(field, str(run_dir), problem)])


def profile_warnings(cfg: Any) -> list[str]:
    """A simulated run on a CPU profile measured with another number of busy ranks than the run
    has: the profile timed each op beside that many busy ranks (on a CPU they share caches and
    memory bandwidth), and a run of fewer ranks meets the machine less loaded. Measured on a
    2-core VM: pcp=1 runs priced on a two-rank profile came out +9..+22%, on a one-rank one
    +5..+9% (docs/profile.md)."""
    measured = getattr(getattr(cfg, "hardware", None), "measured", None)
    if getattr(cfg, "mode", "execute") != "simulate" or measured is None or not measured.device.startswith("cpu"):
        return []
    busy = measured.tp * measured.pcp
    if busy == cfg.world_size:
        return []
    return [f"hardware.path was measured on {busy} busy rank(s) (tp={measured.tp} pcp={measured.pcp}); this run has "
            f"{cfg.world_size}: on a CPU an op runs at another speed beside {'fewer' if busy > cfg.world_size else 'more'} "
            f"busy ranks; for this run's own figures profile its ranks: python -m pcpflow mode=profile tp={cfg.tp} "
            f"pcp={cfg.pcp}"]


def generation_warnings(cfg: Any) -> list[str]:
    """A checkpoint whose generation_config.json sets what transformers' ``generate`` would
    apply and pcpflow does not (``pcpflow.tokens.text.unapplied_generation_settings``): the
    run goes on, its tokens may differ from transformers'."""
    from pcpflow.tokens.text import unapplied_generation_settings

    if getattr(cfg, "mode", "execute") != "execute":
        return []
    unapplied = unapplied_generation_settings(cfg.model)
    if not unapplied:
        return []
    settings = ", ".join(f"{k}={v!r}" for k, v in unapplied.items())
    return [f"the checkpoint's generation_config.json sets {settings}, which pcpflow does not apply (transformers' "
            "generate does): tokens may differ from transformers' (pcpflow applies eos_token_id and repetition_penalty)"]


def capacity_warnings(cfg: Any) -> list[str]:
    """More ranks than this machine can reasonably run at once: they still run, slowly. A
    simulated run starts no ranks; a profile refuses more ranks than cores."""
    if getattr(cfg, "mode", "execute") != "execute":
        return []
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    want = cfg.world_size * cfg.threads_per_rank
    ranks = f"tp*pcp = {cfg.world_size} ranks"
    if cfg.disagg.enabled:
        ranks = f"{cfg.world_size} ranks ({cfg.grid.world_size} prefill + {cfg.world_size - cfg.grid.world_size} decode)"
    unbound = []
    if cfg.cpu_bind == "cores" and want > cores:  # NOTE: the ranks start unbound (rank_cores), whatever the device
        unbound = [f"cpu_bind=cores: {ranks} x threads_per_rank={cfg.threads_per_rank} need {want} cores of their own, "
                   f"this job may use {cores}: the OS places the threads (metrics.cpu_cores: null)"]
    device = getattr(cfg, "device", "auto")
    if device != "cpu":
        try:
            import torch

            if torch.cuda.is_available():
                gpus = torch.cuda.device_count()
                return unbound + ([] if cfg.world_size <= gpus else [f"{ranks} on {gpus} GPU(s): ranks share devices"])
        except Exception:
            pass
    if want > 4 * cores:
        return unbound + [
            f"{ranks} x threads_per_rank={cfg.threads_per_rank} on {cores} CPU core(s): "
            f"the run will be slow (each rank gets {cores / want:.2f} core); step times do not measure the layout"
        ]
    return unbound
