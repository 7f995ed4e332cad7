"""What ``mode=simulate`` adds to validation, in the driver, before anything runs.

``prepare_raw`` (on the composed dict): ``model=hf`` becomes a card read from
``config.json`` alone; the scheduler budget and the KV blocks left ``null`` get their
simulated defaults (a prompt prefilled unchunked, the HBM left after the weights).
``simulate_problems`` (on the validated config): everything a simulation cannot price,
each as a ``Problem`` with the numbers.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import TypeAdapter, ValidationError

from pcpflow.config.hardware import HardwareConfig, SimulateConfig
from pcpflow.errors import ConfigError, Problem
from pcpflow.models.card import CARD_NAMES, ModelCard, card_from_hf_config
from pcpflow.simulate.sizes import DTYPE_BYTES, ModelSizes, model_sizes

GIB = 2**30
SIMULATED_RESTORES = ("all_rows", "sampled_rows")


def hardware_names() -> list[str]:
    from pathlib import Path

    from pcpflow.paths import conf_dir

    return sorted(p.stem for p in (Path(conf_dir()) / "hardware").glob("*.yaml"))


_REQUESTS: dict[tuple, list] = {}


def requests_of(workload, vocab_size: int, seed: int) -> list:
    """``build_requests``, once per workload in this process (validation and the run
    share it: a real-length trace is 10^7 prompt tokens)."""
    from pcpflow.scheduling.workload import build_requests

    key = (workload.model_dump_json(), vocab_size, seed)
    if key not in _REQUESTS:
        _REQUESTS.clear()
        _REQUESTS[key] = build_requests(workload, vocab_size=vocab_size, seed=seed)
    return _REQUESTS[key]


def prepare_raw(raw: dict[str, Any]) -> dict[str, Any]:
    raw = copy.deepcopy(raw)
    model = raw.get("model") or {}
    if model.get("name") == "hf":
        try:
            raw["model"] = card_from_hf_config(model.get("path") or "")
        except ValueError as exc:
            raise ConfigError([Problem("model.path", model.get("path"), f"a checkpoint directory with a config.json; {exc}")]) from None
    sim_raw = raw.setdefault("simulate", {}) or {}
    raw["simulate"] = sim_raw
    if sim_raw.get("weights_dtype") is None:
        sim_raw["weights_dtype"] = (raw.get("model") or {}).get("weights_dtype") or "bf16"
    if raw.get("hardware") is None:
        raise ConfigError([Problem("hardware", None, f"mode=simulate prices on a hardware profile: hardware=one of {', '.join(hardware_names())}")])
    sched, kv = raw.setdefault("scheduler", {}), raw.setdefault("kv", {})
    if sched.get("max_num_batched_tokens") is not None and kv.get("num_blocks") is not None:
        return raw
    try:
        from pcpflow.models import ModelConfig
        from pcpflow.scheduling.workload import WorkloadConfig

        sizes = model_sizes(TypeAdapter(ModelConfig).validate_python(raw["model"]))
        hw = HardwareConfig.model_validate(raw["hardware"])
        sim = SimulateConfig.model_validate(raw.get("simulate") or {})
        workload = TypeAdapter(WorkloadConfig).validate_python(raw["workload"])
        requests = requests_of(workload, sizes.vocab_size, int(raw.get("seed", 0)))
        tp, dcp = int(raw.get("tp", 1)), int(raw.get("dcp", 1))
        block_size, seqs = int(kv.get("block_size", 16)), int(sched.get("max_num_seqs", 256))
    except (ValidationError, ValueError, TypeError, KeyError, ConfigError):
        # NOTE: validation proper reports what is wrong; placeholders only let it run.
        sched.setdefault("max_num_batched_tokens", None)
        sched["max_num_batched_tokens"] = sched["max_num_batched_tokens"] or 1
        kv["num_blocks"] = kv.get("num_blocks") or 1
        return raw
    if sched.get("max_num_batched_tokens") is None:
        # A prompt prefilled unchunked, beside a decode on every other seat.
        sched["max_num_batched_tokens"] = max(len(r.prompt_token_ids) for r in requests) + seqs
    if kv.get("num_blocks") is None:
        per_block = block_bytes(sizes, tp=tp, block_size=block_size, dtype=str(raw.get("dtype", "bfloat16")))
        free = kv_budget_bytes(sizes, hw, sim, tp=tp)
        need = sum(-(-(len(r.prompt_token_ids) + r.max_output_tokens) // (block_size * dcp)) for r in requests)
        kv["num_blocks"] = max(1, min(int(free // per_block), need + 1))
    return raw


def weight_bytes_per_gpu(sizes: ModelSizes, weights_dtype: str, tp: int) -> float:
    """Every linear weight in ``weights_dtype``, embedding and LM head in bf16, split by tp."""
    return (sizes.total_weight_params() * DTYPE_BYTES[weights_dtype] + sizes.embedding_params * 2) / tp


def kv_budget_bytes(sizes: ModelSizes, hw: HardwareConfig, sim: SimulateConfig, *, tp: int) -> float:
    """HBM one GPU has for its KV cache: its usable share less the weights."""
    return hw.hbm_gib * GIB * sim.hbm_utilization - weight_bytes_per_gpu(sizes, sim.weights_dtype, tp)


def block_bytes(sizes: ModelSizes, *, tp: int, block_size: int, dtype: str) -> int:
    """One KV block of one rank, every layer."""
    return block_size * sizes.entry_dim_per_rank(tp) * sizes.num_layers * DTYPE_BYTES[dtype]


def simulate_problems(cfg) -> list[Problem]:
    p: list[Problem] = []
    if cfg.mode == "execute":
        if isinstance(cfg.model, ModelCard):
            p.append(Problem("model", cfg.model.name, "a model card has no weights: run it with mode=simulate "
                             "(executed runs take tiny_mla, tiny_gqa or hf)"))
        return p
    if cfg.hardware is None:
        return [Problem("hardware", None, f"mode=simulate prices on a hardware profile: hardware=one of {', '.join(hardware_names())}")]
    try:
        sizes = model_sizes(cfg.model)
    except ValueError as exc:
        return [Problem("model", cfg.model.name, f"{exc}; cards: {', '.join(CARD_NAMES)}")]
    tp = cfg.tp
    heads_ok = sizes.num_heads % tp == 0
    kv_ok = sizes.attention == "mla" or sizes.num_kv_heads % tp == 0 or tp % sizes.num_kv_heads == 0
    if not (heads_ok and kv_ok):
        allowed = [t for t in range(1, sizes.num_heads + 1) if sizes.num_heads % t == 0
                   and (sizes.attention == "mla" or sizes.num_kv_heads % t == 0 or t % sizes.num_kv_heads == 0)]
        p.append(Problem("tp", tp, f"model {cfg.model.name} has {sizes.num_heads} query heads"
                         + ("" if sizes.attention == "mla" else f" and {sizes.num_kv_heads} KV heads")
                         + f": tp must split them evenly; allowed: {allowed}"))
    if cfg.draft_enabled:
        p.append(Problem("draft", cfg.draft_stage_config().get("kind"), "drafting is not simulated; use draft=none"))
    pipeline = cfg.pipeline or {}
    forward = (pipeline.get("forward") or {}).get("kind", "model")
    if forward != "model":
        p.append(Problem("pipeline.forward.kind", forward, "mode=simulate prices the shipped forward: model"))
    restore = (pipeline.get("restore") or {}).get("kind", "all_rows")
    if restore not in SIMULATED_RESTORES:
        p.append(Problem("pipeline.restore.kind", restore, f"mode=simulate prices one of: {', '.join(SIMULATED_RESTORES)}"))
    p += _hbm_problems(cfg, sizes)
    return p


def _hbm_problems(cfg, sizes: ModelSizes) -> list[Problem]:
    hw, sim, tp, dcp = cfg.hardware, cfg.simulate, cfg.tp, cfg.dcp
    weights = weight_bytes_per_gpu(sizes, sim.weights_dtype, tp)
    usable = hw.hbm_gib * GIB * sim.hbm_utilization
    where = (f"{hw.name} has {hw.hbm_gib:.1f} GiB per GPU, x simulate.hbm_utilization {sim.hbm_utilization} = "
             f"{usable / GIB:.1f} GiB; the {sim.weights_dtype} weights take {weights / GIB:.1f} GiB at tp={tp}")
    if weights >= usable:
        return [Problem("tp", tp, f"the weights do not fit: {where}; raise tp or use simulate.weights_dtype=fp8")]
    free = usable - weights
    per_token = sizes.entry_dim_per_rank(tp) * sizes.num_layers * DTYPE_BYTES[cfg.dtype]
    requests = requests_of(cfg.workload, sizes.vocab_size, cfg.seed)
    tokens = [len(r.prompt_token_ids) + r.max_output_tokens + cfg.num_speculative_tokens for r in requests]
    i = max(range(len(tokens)), key=tokens.__getitem__)
    need = -(-tokens[i] // dcp) * per_token
    out = []
    if need > free:
        out.append(Problem("workload", f"request {i}: {tokens[i]} tokens",
                           f"its KV cache needs {need / GIB:.1f} GiB per GPU ({-(-tokens[i] // dcp)} tokens per DCP shard "
                           f"x {per_token} B), {free / GIB:.1f} GiB are left ({where}); shard it over more ranks "
                           f"(dcp), raise tp, or shorten the request"))
    blocks = cfg.kv.num_blocks * block_bytes(sizes, tp=tp, block_size=cfg.kv.block_size, dtype=cfg.dtype)
    if blocks > free and not out:
        out.append(Problem("kv.num_blocks", cfg.kv.num_blocks,
                           f"{cfg.kv.num_blocks} blocks need {blocks / GIB:.1f} GiB per GPU, {free / GIB:.1f} GiB are left "
                           f"({where}); leave kv.num_blocks unset (null) to fill what is left"))
    return out
