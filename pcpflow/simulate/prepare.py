"""What ``mode=simulate`` adds to validation, in the driver, before anything runs.

``prepare_raw`` (on the composed dict): ``model=hf`` becomes a card read from
``config.json`` alone; the scheduler budget and the KV blocks left ``null`` get their
simulated defaults (a prompt prefilled unchunked, the HBM left after the weights). When the
settings they derive from are themselves invalid, placeholders stand in and are named
(``PLACEHOLDERS``), so that validation reports the real problem and not the placeholder.
``simulate_problems`` (on the validated config): everything a simulation cannot price,
each as a ``Problem`` with the numbers.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import numpy as np
from pydantic import TypeAdapter, ValidationError

from pcpflow.config.choices import allowed_choices
from pcpflow.config.hardware import EXPERT_DTYPES, PEAK_OF_DTYPE, HardwareConfig, SimulateConfig
from pcpflow.config.run import draft_slot
from pcpflow.errors import MISSING, ConfigError, Problem
from pcpflow.models.card import CARD_NAMES, ModelCard, card_from_hf_config
from pcpflow.models.hub import resolve_checkpoint
from pcpflow.scheduling.kv_groups import KVGroups, kv_groups_for
from pcpflow.simulate.sizes import (
    DTYPE_BYTES,
    ModelSizes,
    drafter_sizes,
    model_sizes,
    target_layers,
)

GIB = 2**30
SIMULATED_RESTORES = ("all_rows", "sampled_rows")
DERIVED = ("scheduler.max_num_batched_tokens", "kv.num_blocks")
"""The settings a simulated run derives when left null."""


def unset_derived(raw: dict[str, Any]) -> list[str]:
    """The ``DERIVED`` settings the composed dict leaves null (the run derives them)."""
    out = []
    for field in DERIVED:
        section, key = field.split(".")
        if (raw.get(section) or {}).get(key) is None:
            out.append(field)
    return out


def hardware_names() -> list[str]:
    from pathlib import Path

    from pcpflow.paths import conf_dir

    return sorted(p.stem for p in (Path(conf_dir()) / "hardware").glob("*.yaml"))


_REQUESTS: dict[tuple, Any] = {}


def requests_of(workload, vocab_size: int, seed: int):
    """The workload's ``RequestTable`` by lengths (no token ids: nothing computes on them),
    arrivals in time where the workload says so; once per workload in this process
    (validation and the run share it). Refuses, before building it, a workload whose
    requests alone would not fit in this host's memory."""
    from pcpflow.scheduling.workload import request_table

    # NOTE: JSON writes inf as null: request_rate=inf (all at once, in time) and null (in steps) apart
    key = (workload.model_dump_json(), repr(getattr(workload, "request_rate", None)), vocab_size, seed)
    if key not in _REQUESTS:
        problems = workload_host_problems(workload)
        if problems:
            raise ConfigError(problems)
        _REQUESTS.clear()
        _REQUESTS[key] = request_table(workload, vocab_size=vocab_size, seed=seed, with_tokens=False, simulated=True)
    return _REQUESTS[key]


def prepare_raw(raw: dict[str, Any]) -> tuple[dict[str, Any], frozenset[str]]:
    """The composed dict with its simulated defaults, and the derived settings that hold a
    placeholder (their inputs are invalid: validation reports those, not the placeholder)."""
    raw = copy.deepcopy(raw)
    model = raw.get("model") or {}
    if model.get("name") == "hf":
        if not model.get("path"):
            raise ConfigError([Problem("model.path", model.get("path"), "required with model=hf: a checkpoint "
                                       "directory with a config.json, or a Hugging Face Hub id (model.path=DIR)")])
        try:
            raw["model"] = card_from_hf_config(resolve_checkpoint(str(model.get("path")), weights=False))
        except ValueError as exc:
            raise ConfigError([Problem("model.path", model.get("path"), f"a checkpoint directory with a config.json; {exc}")]) from None
    sim_raw = raw.setdefault("simulate", {}) or {}
    raw["simulate"] = sim_raw
    if sim_raw.get("weights_dtype") is None:
        sim_raw["weights_dtype"] = (raw.get("model") or {}).get("weights_dtype") or _executed_weights(raw)
    if sim_raw.get("expert_weights_dtype") is None:
        experts = (raw.get("model") or {}).get("expert_weights_dtype") or sim_raw["weights_dtype"]
        if experts in EXPERT_DTYPES:  # NOTE: a weights_dtype that is not is said once, on its own field
            sim_raw["expert_weights_dtype"] = experts
    sched, kv = raw.setdefault("scheduler", {}), raw.setdefault("kv", {})
    derive = unset_derived(raw)
    if not derive:
        return raw, frozenset()
    try:
        from pcpflow.models import ModelConfig
        from pcpflow.scheduling.workload import WorkloadConfig

        model = _adapter(ModelConfig).validate_python(raw["model"])
        sizes = model_sizes(model)
        hw = HardwareConfig.model_validate(raw["hardware"])
        sim = SimulateConfig.model_validate(raw.get("simulate") or {})
        workload = _adapter(WorkloadConfig).validate_python(raw["workload"])
        tp, dcp = _positive(raw.get("tp", 1)), _positive(raw.get("dcp", 1))
        block_size, seqs = _positive(kv.get("block_size", 16)), _positive(sched.get("max_num_seqs", 256))
        requests = requests_of(workload, sizes.vocab_size, int(raw.get("seed", 0)))
        draft_w, draft_kv = drafter_memory(draft_slot(raw.get("draft"), raw.get("pipeline")), model, sizes, sim,
                                           tp=tp, weights_dtype=sim.weights_dtype, kv_dtype=sim.kv_dtype,
                                           plugins=raw.get("plugins") or (), expert_dtype=sim.expert_weights_dtype)
        drafting = (draft_slot(raw.get("draft"), raw.get("pipeline")).get("kind") or "none") != "none"
        groups = sizes_kv_groups((raw.get("kv") or {}).get("hybrid", "auto"), sizes, drafting=drafting)
        per_block = (block_bytes(sizes, tp=tp, block_size=block_size, kv_dtype=sim.kv_dtype, groups=groups)
                     + block_size * draft_kv)
        free = kv_budget_bytes(sizes, hw, sim, tp=tp) - draft_w
        if free < per_block:  # NOTE: simulate_problems names what does not fit (weights, or one block)
            raise ValueError("no block fits")
    except (ValidationError, ValueError, TypeError, KeyError, ConfigError, ZeroDivisionError, OverflowError):
        # NOTE: validation proper reports what is wrong; placeholders only let it run (a budget
        # that holds any verify row, so that a drafter does not fail on the placeholder instead).
        for field in derive:
            section, key = field.split(".")
            raw[section][key] = 1 << 20 if field == "scheduler.max_num_batched_tokens" else 1
        disagg = raw.get("disagg") or {}
        if disagg.get("kind") == "pd" and (disagg.get("decode_pool") or {}).get("num_blocks") is None:
            derive.append("disagg.decode_pool.num_blocks")  # it falls back to the placeholder kv.num_blocks
        return raw, frozenset(derive)
    if sched.get("max_num_batched_tokens") is None:
        # A prompt prefilled unchunked, beside a decode on every other seat.
        sched["max_num_batched_tokens"] = int(requests.prompt_lens.max()) + seqs
    disagg = raw.get("disagg") or {}
    pools = disagg.get("kind") == "pd"
    if kv.get("num_blocks") is None:
        # NOTE: a prefill pool's window groups keep the decode pool's whole entries (config.disagg.keep_align)
        align = block_size * _positive((disagg.get("decode_pool") or {}).get("dcp", 1)) if pools else None
        need = int(blocks_for(requests.prompt_lens + requests.output_lens, tokens_per_block=block_size * dcp,
                              groups=groups, max_num_batched_tokens=int(sched["max_num_batched_tokens"]),
                              keep_align=align).sum())
        kv["num_blocks"] = max(1, min(int(free // per_block), need + 1))
    _derive_decode_pool_blocks(raw, sizes, hw, sim, requests, block_size, groups)
    return raw, frozenset()


@functools.cache
def _adapter(annotation: Any) -> TypeAdapter:
    """One adapter per type (building one costs ~1 ms: a search validates thousands of layouts)."""
    return TypeAdapter(annotation)


def _derive_decode_pool_blocks(raw: dict[str, Any], sizes: ModelSizes, hw: HardwareConfig, sim: SimulateConfig,
                               requests, block_size: int, groups: KVGroups | None) -> None:
    """``disagg=pd``: a decode pool without ``num_blocks`` gets the HBM left on one of its GPUs
    (its own tp; a block of a KV group's layers), as the prefill pool's ``kv.num_blocks``; a
    value the settings cannot give is left to validation (the pool's own problems)."""
    disagg = raw.get("disagg") or {}
    pool = disagg.get("decode_pool") or {}
    if disagg.get("kind") != "pd" or pool.get("num_blocks") is not None:
        return
    try:
        tp, dcp = _positive(pool.get("tp", 1)), _positive(pool.get("dcp", 1))
        budget = _positive(pool.get("max_num_batched_tokens") or (raw.get("scheduler") or {})["max_num_batched_tokens"])
    except (ValueError, TypeError, KeyError):
        return
    per_block = block_bytes(sizes, tp=tp, block_size=block_size, kv_dtype=sim.kv_dtype, groups=groups)
    free = kv_budget_bytes(sizes, hw, sim, tp=tp)
    if free >= per_block:
        need = int(blocks_for(requests.prompt_lens + requests.output_lens, tokens_per_block=block_size * dcp,
                              groups=groups, max_num_batched_tokens=budget).sum())
        pool["num_blocks"] = max(1, min(int(free // per_block), need + 1))


def _executed_weights(raw: dict[str, Any]) -> str:
    """A model that executes (tiny_mla, tiny_gqa) holds its weights in the run's dtype: priced
    on a measured profile, its GEMMs run at that dtype; elsewhere (and for cards) bf16."""
    measured = isinstance(raw.get("hardware"), dict) and raw["hardware"].get("tables")
    if measured and (raw.get("model") or {}).get("name") in ("tiny_mla", "tiny_gqa"):
        return PEAK_OF_DTYPE.get(str(raw.get("dtype")), "bf16")
    return "bf16"


def _positive(value: Any) -> int:
    v = int(value)
    if v < 1:
        raise ValueError(f"{value} < 1")
    return v


def weight_bytes_per_gpu(sizes: ModelSizes, weights_dtype: str | None, tp: int, expert_dtype: str | None = None) -> float:
    """One TP rank's weights as ``pcpflow.parallel.tensor_parallel`` leaves them: the linear
    weights in ``weights_dtype`` split by tp, GQA's K/V projections whole per KV head a rank
    holds (``tp / num_kv_heads`` ranks share one when tp exceeds them), MLA's q_a and kv_a
    whole on every rank (the latent all heads share), embedding and LM head in bf16,
    replicated. Routed experts are split by tp as an expert-parallel deployment places them
    (an executed run's tiny MoE keeps every expert on every rank: docs/moe.md), in
    ``expert_dtype`` (None: ``weights_dtype``); shared experts and routers are not routed:
    ``weights_dtype``."""
    if sizes.attention == "gqa":
        (d,) = sizes.head_dims
        extra = sizes.num_layers * 2 * sizes.hidden_size * d * (sizes.kv_heads_per_rank(tp) - sizes.num_kv_heads / tp)
    else:
        q_lora, kv_lora, _, rope, _ = sizes.head_dims
        extra = sizes.num_layers * sizes.hidden_size * ((q_lora or 0) + kv_lora + rope) * (1 - 1 / tp)
    linear = sizes.total_weight_params() / tp + extra
    w = DTYPE_BYTES[weights_dtype or "bf16"]
    # NOTE: + 0.0 where the experts are at weights_dtype: the same float as before they had a dtype
    routed = sizes.routed_expert_params / tp * (DTYPE_BYTES[expert_dtype or weights_dtype or "bf16"] - w)
    return linear * w + routed + sizes.embedding_params * 2


def kv_budget_bytes(sizes: ModelSizes, hw: HardwareConfig, sim: SimulateConfig, *, tp: int) -> float:
    """HBM one GPU has for its KV cache: its usable share less the weights."""
    return hw.hbm_gib * GIB * sim.hbm_utilization - weight_bytes_per_gpu(sizes, sim.weights_dtype, tp,
                                                                          sim.expert_weights_dtype)


def block_bytes(sizes: ModelSizes, *, tp: int, block_size: int, kv_dtype: str, groups: KVGroups | None = None) -> float:
    """One KV block of one rank, in ``simulate.kv_dtype``: every layer's, or with KV groups
    (``pcpflow.scheduling.kv_groups``) the layers of one group."""
    layers = sizes.num_layers if groups is None else groups.size
    return block_size * sizes.entry_dim_per_rank(tp) * layers * DTYPE_BYTES[kv_dtype]


def sizes_kv_groups(hybrid: str, sizes: ModelSizes, *, drafting: bool = False) -> KVGroups | None:
    """The KV groups of a simulated run (``kv_groups_for``) of a model known by its sizes:
    its windowed layers counted (which ones changes no count)."""
    n, w = sizes.num_layers, sizes.sliding_layers
    return kv_groups_for(hybrid, n, range(n - w, n), sizes.window, drafting=drafting)


def blocks_for(lengths: np.ndarray, *, tokens_per_block: int, groups: KVGroups | None,
               max_num_batched_tokens: int, lookahead: int = 0, keep_align: int | None = None) -> np.ndarray:
    """int64: the blocks each request of ``lengths`` tokens holds at most (``fit_problems``'
    count: a block per entry, or per group with KV groups)."""
    entries = -(-np.asarray(lengths, dtype=np.int64) // tokens_per_block)
    if groups is None:
        return entries
    window = groups.peak_window_entries(lengths, tokens_per_block, max_num_batched_tokens, lookahead,
                                        align=keep_align)
    return groups.num_full * entries + groups.num_windowed * window


def drafter_memory(draft: dict[str, Any] | None, model, sizes: ModelSizes, sim, *, tp: int, weights_dtype: str | None,
                   kv_dtype: str, plugins: list[str] | tuple[str, ...] = (),
                   expert_dtype: str | None = None) -> tuple[float, float]:
    """(weight bytes, KV bytes per token) a drafter adds on one GPU: its layers' weights and
    input projection (its embedding and LM head are the target's; ``self`` is the target
    itself) and its cache's entries, every layer, its routed experts (a target's MoE layers)
    in ``expert_dtype``. (0, 0) without a drafter, or for one whose settings validation reports."""
    from pcpflow.pipeline.assemble import load_stages
    from pcpflow.pipeline.stage import UnknownStageError, build_config, resolve

    kind = (draft or {}).get("kind") or "none"
    if kind == "none":
        return 0.0, 0.0
    try:
        load_stages(tuple(plugins))
        work = build_config(resolve(kind, "draft"), dict(draft or {})).work(sizes.num_layers)
    except (UnknownStageError, ImportError, ValueError, TypeError):  # NOTE: validation names what is wrong
        return 0.0, 0.0
    if work is None:
        return 0.0, 0.0
    if work.layer is None:
        return 0.0, sizes.entry_dim_per_rank(tp) * sizes.num_layers * DTYPE_BYTES[kv_dtype]
    own = (target_layers(sizes, work.num_layers) if sim.drafter_layers(model) == "target"
           else drafter_sizes(work.layer, work.num_layers, sizes))
    w = DTYPE_BYTES[weights_dtype or "bf16"]
    weights = weight_bytes_per_gpu(own, weights_dtype, tp, expert_dtype) - own.embedding_params * 2
    weights += max(work.prefill_proj, work.step_proj) * own.hidden_size ** 2 * w
    return weights, own.entry_dim_per_rank(tp) * own.num_layers * DTYPE_BYTES[kv_dtype]


def draft_problems(cfg, sizes: ModelSizes) -> list[Problem]:
    """What keeps a drafter out of a simulated run (``pcpflow.simulate.drafting``): one that
    does not declare its step (``DraftConfig.work``), acceptance nobody gave, and drafting
    beside what the simulator does not draft with (rings, two pools)."""
    from pcpflow.pipeline.assemble import resolve_pipeline

    kind = cfg.draft_stage_config().get("kind")
    spec = next(s for s in resolve_pipeline(cfg) if s.name == "draft")
    work = spec.config.work(sizes.num_layers)
    if work is None:
        return [Problem("draft", kind, "a drafter the simulator can count and price: it declares its step "
                        "(DraftConfig.work); the shipped ones do: self, mtp, dspark")]
    p = []
    if cfg.simulate.draft_acceptance is None and work.error_rate is None:
        p.append(Problem("simulate.draft_acceptance", None, f"draft={kind} proposes what its trained weights "
                         "propose: give the probability that each draft is accepted when the ones before it were, "
                         "e.g. simulate.draft_acceptance=[0.85] (DeepSeek-V3 reports 85-90% for its MTP module's "
                         "draft), or [0.8,0.6] per position"))
    forward = ((cfg.pipeline or {}).get("forward") or {}).get("cp_attention", "allgather")
    if forward != "allgather" or cfg.simulate.cp_decode != "engine":
        p.append(Problem("draft", kind, "drafting is simulated beside the engine's all-gather paths; with a ring "
                         "(pipeline.forward.cp_attention, simulate.cp_decode) use draft=none"))
    if cfg.disagg.enabled:
        p.append(Problem("draft", kind, "drafting is simulated on one pool; with disagg=pd use draft=none"))
    return p


def simulate_problems(cfg) -> list[Problem]:
    p: list[Problem] = []
    if cfg.mode != "simulate":
        if cfg.mode == "execute" and isinstance(cfg.model, ModelCard):
            p.append(Problem("model", cfg.model.name, "a model card has no weights: run it with mode=simulate "
                             "(executed runs take tiny_mla, tiny_gqa or hf)"))
        return p
    if cfg.hardware is None:
        return [Problem("hardware", None, f"mode=simulate and mode=search price on a hardware profile: hardware=one of {', '.join(hardware_names())}")]
    try:
        sizes = model_sizes(cfg.model)
    except ValueError as exc:
        return [Problem("model", cfg.model.name, f"{exc}; cards: {', '.join(CARD_NAMES)}")]
    if cfg.draft_enabled:
        p += draft_problems(cfg, sizes)
    pipeline = cfg.pipeline or {}
    forward = (pipeline.get("forward") or {}).get("kind", "model")
    if forward != "model":
        p.append(Problem("pipeline.forward.kind", forward, "mode=simulate prices the shipped forward: model"))
    restore = (pipeline.get("restore") or {}).get("kind", "all_rows")
    if restore not in SIMULATED_RESTORES:
        p.append(Problem("pipeline.restore.kind", restore, f"what mode=simulate prices; {allowed_choices(restore, SIMULATED_RESTORES)}"))
    if pipeline.get("extra"):
        kinds = [(e or {}).get("kind") if isinstance(e, dict) else e for e in pipeline["extra"]]
        p.append(Problem("pipeline.extra", kinds, "mode=simulate prices the shipped stages only; an extra stage "
                         "would not run: leave +pipeline.extra out"))
    p += dtype_problems(cfg)
    p += objective_problems(cfg)
    p += measured_problems(cfg)
    if cfg.simulate.cp_decode == "ring_pass_q" and not (cfg.pcp > 1 and cfg.dcp == cfg.pcp):
        p.append(Problem("simulate.cp_decode", "ring_pass_q", "the executed ring passes queries over the KV "
                         f"shards of its ring: it needs pcp > 1 and dcp = pcp; got pcp={cfg.pcp} dcp={cfg.dcp} "
                         f"(use engine, or pcp=dcp={max(cfg.pcp, 2)})"))
    texts = [k for k in ("texts", "chats") if getattr(cfg.workload, k, None) is not None]
    if texts:  # NOTE: tokenizing is an executed run's (pcpflow.tokens.text); a simulation prices lengths
        return p + [Problem(f"workload.{texts[0]}", "<" + texts[0] + ">", "a simulated run prices prompt lengths, "
                            "not text: give workload.prompt_lens (or workload.prompts: token ids)")]
    try:
        requests = requests_of(cfg.workload, sizes.vocab_size, cfg.seed)
    except ConfigError as exc:  # the workload's own problems (a trace, its size)
        return p + exc.problems
    p += serving_problems(cfg, requests)
    p += simulated_host_problems(cfg, requests)
    if not any(x.field.startswith(("dtype", "simulate.weights_dtype")) for x in p):
        p += _hbm_problems(cfg, sizes)
        if cfg.disagg.enabled:  # the decode pool's GPUs hold their own slice of the weights and KV
            from pcpflow.config.disagg import pool_config, pool_problems

            decode = pool_config(cfg, "decode")
            # its groups measured
            grid = [x for x in measured_problems(decode) if x.field in ("tp", "pcp", "dcp")]
            p += pool_problems(cfg, _hbm_problems(decode, sizes) + grid, "decode")
            hw = cfg.hardware
            if hw.tables is not None and not hw.nccl and not any(c.op == "sendrecv" for c in hw.tables.collectives):
                p.append(Problem("disagg.kind", "pd", f"the profile {hw.path or hw.name} timed no send/recv (it "
                                 "measured one rank), and the pools' handover is priced from it: profile two ranks "
                                 "(python -m pcpflow mode=profile pcp=2)"))
    return p


def objective_problems(cfg) -> list[Problem]:
    """An objective that counts requests meeting the SLOs needs an SLO."""
    from pcpflow.simulate.decide import OBJECTIVES

    name = cfg.simulate.objective
    if OBJECTIVES[name].needs_slo and cfg.slo.ttft_s is None and cfg.slo.tpot_s is None:
        return [Problem("simulate.objective", name, "goodput counts the requests that meet every SLO: set "
                        "slo.ttft_s and/or slo.tpot_s, or rank by another objective (ttft, tpot, gpus, ttft_x_gpus, "
                        "tpot_x_gpus, throughput_per_gpu)")]
    return []


def measured_problems(cfg) -> list[Problem]:
    """What a measured profile (``hardware=measured``) must hold for this run: the tables of
    its dtype, its attention backend, and the collectives of every group the run has (a
    ring's hops are its send/recv, its partials' exchange its all-to-all)."""
    hw, p = cfg.hardware, []
    if hw.tables is None:
        return p
    from pcpflow.attention.fused import resolve_attention

    where = f"the profile {hw.path or hw.name}"
    att = hw.tables.attention
    p += _table_dtype_problems(cfg.dtype, hw.tables, where)
    forward = (cfg.pipeline or {}).get("forward") or {}
    device = "cpu" if hw.device == "cpu" else "cuda"
    import torch

    backend = resolve_attention(forward.get("attention", "auto"), torch.device(device))
    if att is not None and backend != att.backend:
        p.append(Problem("pipeline.forward.attention", forward.get("attention", "auto"),
                         f"{where} measured the {att.backend} attention backend; this run would use {backend}: "
                         f"set pipeline.forward.attention={att.backend}, or profile with this one"))
    if not hw.nccl:
        measured = sorted({c.ranks for c in hw.tables.collectives})
        grid = cfg.grid
        for name, size in (("tp", grid.tp), ("pcp", grid.pcp), ("dcp", grid.dcp)):
            if size > 1 and size not in measured:
                p.append(Problem(name, size, f"{where} measured collectives on groups of "
                                 f"{' or '.join(map(str, measured)) or 'no'} ranks (tp x pcp = "
                                 f"{hw.measured.tp * hw.measured.pcp if hw.measured else '?'}); profile a grid with "
                                 f"a group of {size}"))
                break
    return p


def _table_dtype_problems(dtype: str, tables, where: str) -> list[Problem]:
    """The run's ``dtype`` in every table the price reads by dtype (gemm, attention prefill and
    decode). A phase with no table at all is the profile's own problem, named by its table;
    a dtype that some tables have and one lacks names that table; a dtype none has, ``dtype``."""
    att, p = tables.attention, []
    again = f"python -m pcpflow mode=profile profile.dtypes=[{dtype}]"
    by_dtype = {"tables.gemm": tables.gemm}
    for phase in ("prefill", "decode"):
        table = getattr(att, phase)
        if table:
            by_dtype[f"tables.attention.{phase}"] = table
            continue
        p.append(Problem(f"hardware.tables.attention.{phase}", table if phase in att.model_fields_set else MISSING,
                         f"{where} has no {phase} attention table; a simulated run prices {phase} attention on "
                         f"tables.attention.{phase}.{dtype} (mode=profile writes prefill and decode): profile again "
                         f"({again})"))
    have = [d for d in tables.gemm if all(d in t for t in by_dtype.values())]
    lacking = [name for name, t in by_dtype.items() if dtype not in t]
    if not lacking:
        return p
    if len(lacking) == len(by_dtype):  # measured nowhere: the run's dtype is the one to change
        return p + [Problem("dtype", dtype, f"{where} measured {' | '.join(have) or 'no dtype'}; run at one of "
                            f"them, or profile this one ({again})")]
    measured = [name for name in by_dtype if name not in lacking]
    for name in lacking:
        what = f"{name.rsplit('.', 1)[-1]} attention table" if "attention" in name else "gemm table"
        p.append(Problem(f"hardware.{name}", sorted(by_dtype[name]), f"{where} measured {dtype} in "
                         f"{' and '.join(measured)}, but its {what} has {', '.join(sorted(by_dtype[name]))} only: "
                         + (f"run at a dtype measured throughout ({' | '.join(have)}), or " if have else "")
                         + f"profile {dtype} again ({again})"))
    return p


def dtype_problems(cfg) -> list[Problem]:
    """Every dtype a simulated run prices must have a peak on its hardware: the activations'
    (the ``PEAK_OF_DTYPE`` mapping) and the weights' (``simulate.weights_dtype``). A measured
    profile says which dtypes it measured (``measured_problems``)."""
    hw, p = cfg.hardware, []
    if hw.tables is not None:
        return p
    known = [f"{k} ({v})" for k, v in PEAK_OF_DTYPE.items() if hw.peak(v) is not None]
    if cfg.dtype not in PEAK_OF_DTYPE or hw.peak(PEAK_OF_DTYPE[cfg.dtype]) is None:
        p.append(Problem("dtype", cfg.dtype, f"{hw.name} prices activations at a peak of hardware.peak_tflops; "
                         f"allowed: {', '.join(known)}"))
    weights = cfg.simulate.weights_dtype
    have = [k for k in ("bf16", "fp8", "fp4", "fp32", "fp64") if hw.peak(k) is not None]
    if weights is not None and hw.peak(weights) is None:
        p.append(Problem("simulate.weights_dtype", weights, f"{hw.name} has no {weights} tensor-core peak "
                         f"(hardware.peak_tflops.{weights}: null); {allowed_choices(weights, have)}"))
    # NOTE: mxfp4 experts compute at the activations' peak (weight-only: pcpflow.simulate.price.gemm_peak_key);
    # experts at weights_dtype are that field's problem
    experts = cfg.simulate.expert_weights_dtype
    if experts not in (None, "mxfp4", weights) and hw.peak(experts) is None:
        p.append(Problem("simulate.expert_weights_dtype", experts, f"{hw.name} has no {experts} tensor-core peak "
                         f"(hardware.peak_tflops.{experts}: null); {allowed_choices(experts, [*have, 'mxfp4'])}"))
    return p


def serving_problems(cfg, requests) -> list[Problem]:
    """What replicas behind a router need: arrivals in time (a router sends a request the
    moment it arrives), and a prefix cache for ``prefix_aware`` to look in."""
    p = []
    serving = cfg.serving
    if serving.replicas > 1 and not requests.timed:
        p.append(Problem("serving.replicas", serving.replicas, "replicas behind a router take requests as they arrive "
                         "in time: give workload.request_rate (inf: all at once), or replay a trace's timestamps "
                         "(workload.step_ms=null); or serving.replicas=1"))
    if serving.router == "prefix_aware" and serving.replicas > 1 and not cfg.kv.prefix_caching:
        p.append(Problem("serving.router", "prefix_aware", "prefix_aware routes by the prefix cache: set "
                         "kv.prefix_caching=true, or use round_robin or least_loaded"))
    return p


def _hbm_problems(cfg, sizes: ModelSizes) -> list[Problem]:
    hw, sim, tp, dcp = cfg.hardware, cfg.simulate, cfg.tp, cfg.dcp
    experts = sim.expert_weights_dtype
    draft_w, draft_kv = drafter_memory(cfg.draft_stage_config() if cfg.draft_enabled else None, cfg.model, sizes, sim, tp=tp,
                                       weights_dtype=sim.weights_dtype, kv_dtype=sim.kv_dtype, plugins=cfg.plugins,
                                       expert_dtype=experts)
    weights = weight_bytes_per_gpu(sizes, sim.weights_dtype, tp, experts) + draft_w
    usable = hw.hbm_gib * GIB * sim.hbm_utilization
    mixed = f" ({experts} routed experts)" if sizes.num_experts and experts not in (None, sim.weights_dtype) else ""
    where = (f"{hw.name} has {hw.hbm_gib:.1f} GiB per GPU, x simulate.hbm_utilization {sim.hbm_utilization} = "
             f"{usable / GIB:.1f} GiB; the {sim.weights_dtype} weights{mixed} take {weights / GIB:.1f} GiB at tp={tp}"
             + (f" (the drafter's {draft_w / GIB:.1f} GiB included)" if draft_w else ""))
    if weights >= usable:
        # NOTE: a narrower dtype is advice only where the weights are wider than fp8 already
        narrower = " or use simulate.weights_dtype=fp8" if sim.weights_dtype in ("bf16", "fp32", "fp64") else ""
        return [Problem("tp", tp, f"the weights do not fit: {where}; raise tp{narrower}")]
    free = usable - weights
    groups = sizes_kv_groups(cfg.kv.hybrid, sizes, drafting=cfg.draft_enabled)
    per_token = (sizes.entry_dim_per_rank(tp) * (sizes.num_layers if groups is None else groups.size)
                 * DTYPE_BYTES[sim.kv_dtype] + draft_kv)
    per_block = cfg.kv.block_size * per_token
    if per_block > free:
        return [Problem("kv.block_size", cfg.kv.block_size,
                        f"one block of {cfg.kv.block_size} tokens needs {per_block / GIB:.1f} GiB per GPU "
                        f"({per_token} B a token), {free / GIB:.1f} GiB are left ({where}); vLLM's blocks are 16 tokens")]
    requests = requests_of(cfg.workload, sizes.vocab_size, cfg.seed)
    tokens = requests.prompt_lens + requests.output_lens + cfg.num_speculative_tokens
    i = int(np.argmax(tokens))
    out = []
    if groups is None:
        tokens = tokens.tolist()
        need = -(-tokens[i] // dcp) * per_token
        held = f"{-(-tokens[i] // dcp)} tokens per DCP shard x {per_token} B"
    else:  # NOTE: its window groups hold their windows only
        blocks = int(blocks_for(tokens[i:i + 1], tokens_per_block=cfg.kv.block_size * dcp, groups=groups,
                                max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens)[0])
        need = blocks * per_block
        tokens = tokens.tolist()
        held = f"{blocks} blocks in {groups.num_groups} KV groups x {per_block} B"
    if need > free:
        out.append(Problem("workload", f"request {i}: {tokens[i]} tokens",
                           f"its KV cache needs {need / GIB:.1f} GiB per GPU ({held}), {free / GIB:.1f} GiB are "
                           f"left ({where}); shard it over more ranks (dcp), raise tp, or shorten the request"))
    blocks = cfg.kv.num_blocks * per_block
    if blocks > free and not out:
        out.append(Problem("kv.num_blocks", cfg.kv.num_blocks,
                           f"{cfg.kv.num_blocks} blocks need {blocks / GIB:.1f} GiB per GPU, {free / GIB:.1f} GiB are left "
                           f"({where}); leave kv.num_blocks unset (null) to fill what is left"))
    return out


# -- host memory: what a simulated run holds ---------------------------------------------------
SIM_BYTES_PER_REQUEST = 512
"""A request in a simulated run: its lengths and arrival, its scheduling state and its timing
columns (int64 and float64 columns; measured ~350 B, rounded up)."""
SIM_BYTES_PER_BATCH_TOKEN = 256
"""A scheduled token in one step: the batch, the layout and the counts' int64 arrays."""
SIM_BYTES_PER_BLOCK = 96
"""A KV block of the pool (reference count, hash, free-queue entries) and a block-table entry."""


def _host_budget() -> tuple[int, int] | None:
    from pcpflow.scheduling.memory import HOST_MEMORY_FRACTION, host_memory_bytes

    available = host_memory_bytes()
    return None if available is None else (int(available * HOST_MEMORY_FRACTION), available)


def _need(nbytes: float, budget: tuple[int, int], what: str) -> str:
    from pcpflow.output.report import human_bytes

    return (f"a size this host can hold: {what} need ~{human_bytes(nbytes)}, and "
            f"{human_bytes(budget[0])} of memory is available to the run (80% of {human_bytes(budget[1])})")


def workload_host_problems(workload) -> list[Problem]:
    """The number of requests alone (before any is built: a simulated run holds a few
    numbers per request, never its token ids)."""
    budget = _host_budget()
    n = getattr(workload, "num_requests", None)
    if budget is None or n is None or getattr(workload, "kind", None) == "trace":
        return []
    nbytes = n * SIM_BYTES_PER_REQUEST
    if nbytes <= budget[0]:
        return []
    field = "workload.num_requests" if workload.kind == "synthetic" else "workload.prompt_lens"
    return [Problem(field, n, _need(nbytes, budget, f"{n:,} requests ({SIM_BYTES_PER_REQUEST} B each)"))]


def simulated_host_problems(cfg, requests) -> list[Problem]:
    """What the run holds at its largest, each size named by the setting that sets it: the
    requests, one step's arrays (``scheduler.max_num_batched_tokens``: the default prefills
    the longest prompt at once), the KV pool (``kv.num_blocks``) and the block tables and
    block hashes of the longest requests (``workload``)."""
    budget = _host_budget()
    if budget is None:
        return []
    U = cfg.kv.block_size * cfg.dcp
    longest_blocks = int((-(-(requests.prompt_lens + requests.output_lens) // U)).max(initial=0))
    seats = min(cfg.scheduler.max_num_seqs, len(requests))
    sizes = {
        "workload": (len(requests) * SIM_BYTES_PER_REQUEST + 2 * 8 * seats * longest_blocks * (1 + cfg.kv.prefix_caching),
                     f"{len(requests):,} requests and the block tables of {seats} running ones of up to "
                     f"{longest_blocks:,} blocks"),
        "scheduler.max_num_batched_tokens": (cfg.scheduler.max_num_batched_tokens * SIM_BYTES_PER_BATCH_TOKEN,
                                             f"a step of {cfg.scheduler.max_num_batched_tokens:,} tokens"),
        "kv.num_blocks": (cfg.kv.num_blocks * SIM_BYTES_PER_BLOCK, f"{cfg.kv.num_blocks:,} KV blocks"),
    }
    problems = []
    for field, (nbytes, what) in sizes.items():
        if nbytes > budget[0]:
            given = {"workload": f"{len(requests):,} requests, the longest {longest_blocks * U:,} tokens",
                     "scheduler.max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
                     "kv.num_blocks": cfg.kv.num_blocks}[field]
            problems.append(Problem(field, given, _need(nbytes, budget, what)))
    total = sum(v for v, _ in sizes.values())
    if not problems and total > budget[0]:
        problems.append(Problem("workload", f"{len(requests):,} requests", _need(total, budget, "requests, a step and the KV pool together")))
    return problems
