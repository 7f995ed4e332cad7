"""Which device and collective backend each rank uses.

Rank -> device: ``cuda:LOCAL_RANK`` (set by pcpflow's elastic launch and by torchrun /
srun wrappers), else ``cuda:0`` for a rank started without one (the in-process pcp=1
run). NCCL on CUDA, gloo on CPU. NCCL cannot put two ranks on one GPU, and gloo on CUDA
tensors would stage every collective through the host (and was never run here), so a
run with more ranks on a node than visible GPUs is refused before any rank starts
(exit 2) rather than sharing a GPU; multi-rank layouts run on CPU (``device=cpu``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pcpflow.errors import Problem
from pcpflow.scheduling.memory import HOST_MEMORY_FRACTION, host_memory_bytes

if TYPE_CHECKING:
    from pcpflow.config.run import RunConfig


def local_rank() -> int:
    """This process's rank on its node (``LOCAL_RANK``; 0 when no launcher set it)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


@contextmanager
def rank_threads(threads: int, cpu_bind: str = "none") -> Iterator[set[int] | None]:
    """This rank's torch threads (``threads_per_rank``) and, with ``cpu_bind=cores``, the
    cores they run on (``rank_cores``; yielded, None where unbound); both restored after
    (the in-process rank is the driver's own thread)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    cores = rank_cores(threads) if cpu_bind == "cores" else None
    before = os.sched_getaffinity(0) if cores else None
    if cores:
        os.sched_setaffinity(0, cores)  # NOTE: this thread, and the threads it starts from now on
    try:
        yield cores
    finally:
        torch.set_num_threads(saved)
        if before is not None:
            os.sched_setaffinity(0, before)


def rank_cores(threads: int) -> set[int] | None:
    """The cores of this rank under ``cpu_bind=cores``: the r-th rank of its node (``LOCAL_RANK``,
    else its rank in the group) takes the r-th ``threads`` of the cores this process may use,
    in order; None where the node's ranks (``LOCAL_WORLD_SIZE``, else the group) would not fit
    them, or the platform cannot bind."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    import torch.distributed as dist

    group = dist.is_initialized()
    rank = int(os.environ.get("LOCAL_RANK", dist.get_rank() if group else 0))
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size() if group else 1))
    cores = sorted(os.sched_getaffinity(0))
    if ranks * threads > len(cores):
        return None
    return set(cores[rank * threads:(rank + 1) * threads])


def uses_cuda(device: str) -> bool:
    """``device`` (cpu | cuda | auto) means CUDA here."""
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def pick_device(device: str) -> torch.device:
    """This rank's device for the run's ``device`` setting."""
    if not uses_cuda(device):
        return torch.device("cpu")
    rank, count = local_rank(), torch.cuda.device_count()
    if rank >= count:
        raise RuntimeError(
            f"local rank {rank} has no GPU of its own ({count} visible): start at most "
            f"{count} ranks per node, or use device=cpu"
        )
    return torch.device("cuda", rank)


def pick_backend(backend: str, device: torch.device) -> str:
    """The collective backend for the run's ``backend`` setting on ``device``."""
    if backend != "auto":
        return backend
    return "nccl" if device.type == "cuda" else "gloo"


def device_problems(cfg: RunConfig) -> list[Problem]:
    """Device/backend settings that cannot run here (checked in the driver)."""
    p: list[Problem] = []
    if cfg.backend == "nccl" and cfg.device == "cpu":
        p.append(
            Problem("backend", "nccl", "nccl needs device=cuda (or auto on a GPU machine); use gloo")
        )
    if cfg.device == "cuda" or cfg.backend == "nccl":
        if not torch.cuda.is_available():
            field, given = ("device", "cuda") if cfg.device == "cuda" else ("backend", "nccl")
            p.append(
                Problem(field, given, "no CUDA device is visible here; use device=cpu / backend=gloo")
            )
            return p
    if cfg.device != "cpu" and torch.cuda.is_available():
        count, needed = torch.cuda.device_count(), ranks_on_this_node(cfg.world_size)
        if count < needed:
            p.append(
                Problem(
                    "pcp",
                    cfg.pcp,
                    f"needs {needed} GPUs on this node, {count} visible (one rank per GPU: "
                    "NCCL cannot put two ranks on one GPU, and gloo on CUDA tensors stages "
                    f"every collective through the host); run tp*pcp <= {count} on the GPU, "
                    "or device=cpu",
                )
            )
    return p


def ranks_on_this_node(world_size: int) -> int:
    """``LOCAL_WORLD_SIZE`` under torchrun / srun wrappers; every rank under pcpflow's
    own launch (one node)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


# ------------------------------------------------------------------------------ host memory

_BUFFER_BYTES_PER_TOKEN = 16 * 8  # a step's int64 columns (ids, positions, slots, indices ...)
_BUFFER_BYTES_PER_SEQ = 2 * 8 * 8  # 2 * max_num_seqs rows of per-request int64 columns


def host_memory_problems(cfg: Any, prompt_lens: np.ndarray, output_lens: np.ndarray, specs: list | None = None) -> list[Problem]:
    """An executed run's allocations on this host (every rank of it, and the reference on
    rank 0) fit in its available memory. Each size that alone is too big is named.

    Counted: the model's weights whole on every rank (each builds the whole model, then
    keeps its TP share: the peak is the whole), the KV caches (the target's, of a TP rank's
    KV heads; a drafter's own, whole), and with ``verify=true`` each rank's
    expected copies and the reference's whole-context cache and, under TP, its whole
    model; the step buffers; every rank's token ids. Not counted, left to the share of
    memory held back: a drafter's weights (small beside the target's), activations, and each
    rank process's own (measured here: ~70 MB of private and proportional memory a rank under
    pcpflow's launch, whose ranks share torch's pages; ~230 MB a rank under torchrun). ``specs``: the resolved pipeline, whose
    drafter's cache is counted (``DraftConfig.cache_entry_width``); None: none is."""
    available = host_memory_bytes()
    if available is None:
        return []
    budget = int(available * HOST_MEMORY_FRACTION)
    ranks = cfg.world_size + (1 if cfg.verify else 0)  # the reference's buffers and token ids
    sizes = _host_sizes(cfg, prompt_lens, output_lens, specs or [])
    problems = []
    for field, nbytes in sizes.items():
        if nbytes > budget:
            given = _given(cfg, field)
            problems.append(
                Problem(
                    field,
                    given,
                    f"a size this host can allocate: {ranks} rank(s) would need {_gib(nbytes)} for it alone, "
                    f"and {_gib(budget)} of memory is available to the run "
                    f"({HOST_MEMORY_FRACTION:.0%} of {_gib(available)})",
                )
            )
    total = sum(sizes.values())
    if not problems and total > budget:
        problems.append(Problem("kv.num_blocks", cfg.kv.num_blocks, f"a run that fits this host: weights, KV caches, buffers and workload together need {_gib(total)}, {_gib(budget)} is available"))
    return problems


def _host_sizes(cfg: Any, prompt_lens: np.ndarray, output_lens: np.ndarray, specs: list) -> dict[str, int]:
    """Bytes on this host by the setting that sizes them (``host_memory_problems``)."""
    from pcpflow.config.disagg import POOLS, pool_config

    entry, drafter, hidden_bytes, weight_bytes = _model_bytes(cfg, specs)
    pools = [pool_config(cfg, name) for name in (POOLS if cfg.disagg.enabled else ("prefill",))]
    # NOTE: a TP rank's target cache holds its KV heads only (a drafter's is counted whole)
    kv = sum(p.grid.world_size * p.kv.num_blocks * p.kv.block_size * (entry(p.tp) + drafter) for p in pools)
    weights = cfg.world_size * weight_bytes
    ranks = cfg.world_size
    if cfg.verify:  # NOTE: pcpflow.rank.verify: expected copies; the reference's cache (and model, under TP)
        from pcpflow.rank.verify import reference_blocks

        ref_blocks = reference_blocks(pools, prompt_lens + output_lens, cfg.num_speculative_tokens)
        kv = 2 * kv + ref_blocks * cfg.kv.block_size * (entry(1) + drafter)
        weights += weight_bytes if cfg.tp > 1 else 0
        ranks += 1
    return {
        "model": weights,
        "kv.num_blocks": kv,
        "scheduler.max_num_batched_tokens": ranks * cfg.scheduler.max_num_batched_tokens * (_BUFFER_BYTES_PER_TOKEN + 4 * hidden_bytes),
        "scheduler.max_num_seqs": ranks * cfg.scheduler.max_num_seqs * _BUFFER_BYTES_PER_SEQ,
        "workload": ranks * 3 * 8 * int(prompt_lens.sum() + output_lens.sum()),  # token ids: requests, scheduler
    }


def _given(cfg: Any, field: str) -> Any:
    if field == "workload":
        return getattr(cfg.workload, "path", None) or cfg.workload.kind
    if field == "model":
        return getattr(cfg.model, "path", None) or cfg.model.name
    section, key = field.split(".")
    return getattr(getattr(cfg, section), key)


def _model_bytes(cfg: Any, specs: list) -> tuple[Callable[[int], int], int, int, int]:
    """Bytes of (one token's target KV entries over all layers on one rank of ``tp``, as a
    function of tp; one token's drafter KV entries; one hidden row; the whole model's weights),
    from the model built on the meta device (no memory, no weights read) and the drafter's
    ``DraftConfig.cache_entry_width``."""
    import torch

    from pcpflow.models import build_model
    from pcpflow.parallel.tensor_parallel import local_spec
    from pcpflow.pipeline.context import DTYPES
    from pcpflow.scheduling.kv_groups import run_kv_groups

    dtype = DTYPES[cfg.dtype]
    size = torch.empty((), dtype=dtype).element_size()
    try:
        model = build_model(cfg.model, dtype=dtype, seed=0, device="meta")
    except Exception:  # a model that cannot be built on meta: price it as 1 kB per layer
        return lambda tp: 1024, 0, 1024, 0
    draft = next((s.config for s in specs if s.name == "draft"), None)
    drafter = draft.cache_entry_width(model) if hasattr(draft, "cache_entry_width") else 0
    weights = sum(p.numel() for p in model.parameters()) * size

    spec = model.attn_spec
    # NOTE: with KV groups a block holds one group's layers (pcpflow.scheduling.kv_groups)
    groups = run_kv_groups(cfg, model.num_layers, spec.window_layers, spec.windowed())
    layers = model.num_layers if groups is None else groups.size

    def entry(tp: int) -> int:
        # NOTE: a tp that does not split the KV heads is refused by the TP checks: count it whole
        splits = spec.v_offset == 0 or spec.num_kv_heads % tp == 0 or tp % spec.num_kv_heads == 0
        return layers * (local_spec(spec, 0, tp) if splits else spec).entry_dim * size

    return entry, drafter * size, model.hidden_size * size, weights


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"
