"""Prefill/decode disaggregation (``disagg=pd``): a prefill pool and a decode pool, each a
rank grid of today's rules (docs/disaggregation.md).

With ``disagg=pd`` the top-level ``tp``, ``pcp``, ``dcp`` and ``kv.interleave`` describe the
**prefill pool** (global ranks ``0 .. Wp-1``) and ``disagg.decode_pool.*`` the **decode pool**
(global ranks ``Wp .. Wp+Wd-1``): the world is both pools' ranks. Each pool runs the same
pipeline with its own view of the run config (``pool_config``): its grid, its KV geometry,
its KV blocks and scheduler budget. ``kv.num_blocks`` and ``scheduler.*`` size the prefill
pool, and the decode pool too unless ``disagg.decode_pool.num_blocks`` /
``max_num_seqs`` / ``max_num_batched_tokens`` give it its own. ``decode=`` applies to the
decode pool (the prefill pool runs prefills only). Prefix caching is the prefill pool's:
the decode pool receives every entry (a request preempted there recomputes in full).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field

from pcpflow.errors import Problem, Settings
from pcpflow.layouts.ring import CP_ATTENTION
from pcpflow.parallel.grid import RankGrid

# NOTE: the run config (pcpflow.config.run.RunConfig) holds a DisaggConfig: it is typed Any here,
# so that this module does not import its importer back
RunConfig = Any

POOLS = ("prefill", "decode")
POOL_FIELDS = ("tp", "pcp", "dcp", "kv.interleave", "kv.num_blocks", "scheduler.max_num_seqs",
               "scheduler.max_num_batched_tokens", "pipeline.forward.cp_attention")
"""The settings each pool has its own of (the decode pool's under ``disagg.decode_pool``)."""


class DecodePoolConfig(Settings):
    """The decode pool's grid and sizes (defaults: one rank, the top-level sizes)."""

    tp: int = Field(1, ge=1, description="tensor parallel size of the decode pool")
    pcp: int = Field(1, ge=1, description="prefill context parallel size of the decode pool (its recomputed prefills)")
    dcp: int = Field(1, ge=1, description="decode context parallel size of the decode pool (KV shards), by the grid's rules")
    interleave: int = Field(1, ge=1, description="the decode pool's DCP interleave: position p lives on its DCP rank (p // I) % dcp")
    num_blocks: int | None = Field(
        None, ge=1, description="KV blocks per decode rank and layer; null: kv.num_blocks (simulated: the HBM left "
        "after the weights on a decode GPU)")
    max_num_seqs: int | None = Field(None, ge=1, description="most requests running on the decode pool; null: scheduler.max_num_seqs")
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="token budget of a decode-pool step; null: scheduler.max_num_batched_tokens")
    cp_attention: Literal[CP_ATTENTION] = Field(  # type: ignore[valid-type]
        "allgather", description="how the decode pool's attention crosses its ranks: allgather (its DCP path) | "
        "ring_pass_q (Meta's decode ring) | ring_pass_kv | ring_auto; a ring needs the pool's dcp = pcp > 1 "
        "(pipeline.forward.cp_attention is the prefill pool's)")


class DisaggConfig(Settings):
    kind: Literal["none", "pd"] = Field(
        "none", description="none: one pool (tp x pcp ranks); pd: a prefill pool (tp, pcp, dcp, kv.interleave) hands "
        "each request's KV to a decode pool (disagg.decode_pool), point to point")
    decode_pool: DecodePoolConfig = Field(default_factory=DecodePoolConfig)
    transfer: Literal["layerwise", "after_prefill"] = Field(
        "layerwise", description="layerwise: a message per layer, each leaving as soon as written (LMCache's "
        "layerwise mode; priced overlapped with the prefill); after_prefill: one message per route after the "
        "prefill (vLLM's NixlConnector)")

    @property
    def enabled(self) -> bool:
        return self.kind == "pd"

    @property
    def decode_grid(self) -> RankGrid:
        d = self.decode_pool
        return RankGrid(tp=d.tp, pcp=d.pcp, dcp=d.dcp)


def pool_config(cfg: RunConfig, pool: str) -> RunConfig:
    """The run config as pool ``pool`` sees it: its grid, KV geometry and budget at the
    top level, one pool (``disagg=none``). ``cfg`` itself for a run without pools."""
    if not cfg.disagg.enabled:
        return cfg
    if pool not in POOLS:
        raise ValueError(f"pool {pool!r}: one of {', '.join(POOLS)}")
    one = type(cfg.disagg)()
    if pool == "prefill":  # NOTE: decode= applies to the decode pool; the prefill pool runs prefills only
        return cfg.model_copy(update={"disagg": one, "decode": type(cfg.decode)()})
    d = cfg.disagg.decode_pool
    kv = cfg.kv.model_copy(update={"interleave": d.interleave, "num_blocks": d.num_blocks or cfg.kv.num_blocks,
                                   "prefix_caching": False})
    sched = cfg.scheduler.model_copy(update={
        "max_num_seqs": d.max_num_seqs or cfg.scheduler.max_num_seqs,
        "max_num_batched_tokens": d.max_num_batched_tokens or cfg.scheduler.max_num_batched_tokens})
    # NOTE: pipeline.forward.cp_attention is the prefill pool's; the decode pool's is its own
    pipeline = dict(cfg.pipeline or {})
    pipeline["forward"] = {**(pipeline.get("forward") or {}), "cp_attention": d.cp_attention}
    return cfg.model_copy(update={"tp": d.tp, "pcp": d.pcp, "dcp": d.dcp, "kv": kv, "scheduler": sched, "disagg": one,
                                  "pipeline": pipeline})


def keep_align(cfg: RunConfig) -> int | None:
    """The positions a decode-pool table entry holds (``kv.block_size`` x its dcp): what the
    prefill pool's windowed KV groups keep whole, so that a handover finds every entry the
    decode pool keeps (``KVCacheManager.keep_align``); None without pools."""
    return cfg.kv.block_size * cfg.disagg.decode_pool.dcp if cfg.disagg.enabled else None


def pool_field(pool: str, field: str) -> str:
    """Where pool ``pool``'s setting ``field`` (a top-level name: tp, dcp, kv.num_blocks) lives."""
    if pool == "prefill":
        return field
    key = field.split(".")[-1]
    return f"disagg.decode_pool.{key}"


def pool_problems(cfg: RunConfig, problems: list[Problem], pool: str) -> list[Problem]:
    """``problems`` found on pool ``pool``'s config, named by the pool's own settings and
    saying which pool (``the decode pool (tp=2 pcp=1 dcp=4): ...``)."""
    if not cfg.disagg.enabled:
        return problems
    grid = cfg.grid if pool == "prefill" else cfg.disagg.decode_grid
    where = f"the {pool} pool (tp={grid.tp} pcp={grid.pcp} dcp={grid.dcp})"
    out = []
    for p in problems:
        field, allowed, pool_where = p.field, p.allowed, where
        if field in POOL_FIELDS:
            field = pool_field(pool, field)
            if "." in p.field:  # NOTE: "kv.num_blocks must be >= 4" names the setting to raise
                allowed = allowed.replace(f"{p.field} ", f"{field} ")
            if pool == "decode" and getattr(cfg.disagg.decode_pool, field.split(".")[-1], 0) is None:
                pool_where += f", which takes {p.field} as {field} is null"  # NOTE: the value given is the top-level one
        if pool == "decode":  # NOTE: a hint's keys are the pool's: "(use dcp=2 pcp=2)" sets disagg.decode_pool.*
            allowed = _HINT.sub(lambda m: _HINT_KEY.sub(r"disagg.decode_pool.\1=", m.group(0)), allowed)
        out.append(Problem(field, p.given, f"{pool_where}: {allowed}"))
    return out


_HINT = re.compile(r"\(use [^)]*\)")
_HINT_KEY = re.compile(r"\b(tp|pcp|dcp|cp_attention)=")


def disagg_problems(cfg: RunConfig) -> list[Problem]:
    """The pools' own rules: each pool's grid (named by pool, with its numbers), the decode
    pool's interleave against ``kv.block_size``, and ``disagg.*`` settings without
    ``disagg=pd``. The prefill pool's grid rules are the top-level ones (the config's own)."""
    d = cfg.disagg
    default = DisaggConfig()
    if not d.enabled:
        keys = {f"disagg.decode_pool.{k}": getattr(d.decode_pool, k) for k in DecodePoolConfig.model_fields
                if getattr(d.decode_pool, k) != getattr(default.decode_pool, k)}
        if d.transfer != default.transfer:
            keys["disagg.transfer"] = d.transfer
        if keys:
            return [Problem("disagg", keys, "settings of disagg=pd, and this run is disagg=none: add disagg=pd or "
                            "leave them out")]
        return []
    p = pool_problems(cfg, d.decode_grid.problems(), "decode")
    if cfg.kv.block_size % d.decode_pool.interleave:
        p.append(Problem("disagg.decode_pool.interleave", d.decode_pool.interleave,
                         f"must divide kv.block_size={cfg.kv.block_size} (the decode pool's blocks)"))
    if cfg.mode not in ("execute", "simulate"):
        p.append(Problem("disagg", "pd", f"mode={cfg.mode} measures one rank grid: run it with disagg=none"))
    if cfg.mode == "simulate" and cfg.simulate.cp_decode != "engine":
        p.append(Problem("simulate.cp_decode", cfg.simulate.cp_decode, "with disagg=pd the decode pool runs the "
                         "attention its own key names: use engine and disagg.decode_pool.cp_attention=ring_pass_q"))
    if cfg.mode == "simulate" and cfg.serving.replicas > 1:
        p.append(Problem("serving.replicas", cfg.serving.replicas, "one prefill pool and one decode pool per instance "
                         "(several of either, xPyD, are out of scope): serving.replicas=1 with disagg=pd"))
    return p
