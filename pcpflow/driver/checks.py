"""The pre-run check layer: everything the driver can find wrong before a rank starts.

``check_job(cfg, kind=...)`` raises one ConfigError listing every problem (exit code 2):
the stages (after importing plugins), the workload (from its lengths alone: no token array
is built to find out that it is too big), the KV cache and the buffers (sizes this host
cannot allocate), the checkpoint (safetensors headers against config.json), the seeds.
It knows the kind of run: an executed run allocates on this host, so host memory bounds
it; a simulated run (``mode=simulate``) reads only config.json and sizes its KV cache
from the hardware it prices, so host-memory limits are skipped.

``check_run_dir`` and ``capacity_warnings`` are the driver's checks of where and how the
ranks will run.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from pcpflow.errors import ConfigError, Problem

SEED_RANGE = (-(2**63), 2**63 - 1)
"""What every RNG of a run takes: torch.manual_seed wants a 64-bit integer (numpy's
SeedSequence takes the low 64 bits of it)."""

HOST_MEMORY_FRACTION = 0.8
"""An executed run may plan to use this much of the host's available memory."""

_BUFFER_BYTES_PER_TOKEN = 16 * 8  # a step's int64 columns (ids, positions, slots, indices ...)
_BUFFER_BYTES_PER_SEQ = 2 * 8 * 8  # 2 * max_num_seqs rows of per-request int64 columns


def check_job(cfg: Any, raw: dict[str, Any] | None = None, *, kind: str | None = None) -> Any:
    """Every pre-run check; returns ``cfg`` with the fields derived from its stages
    (``num_speculative_tokens``), raises ConfigError listing every problem."""
    kind = kind or getattr(cfg, "mode", "execute")
    problems = check_plugins(cfg) + check_seeds(cfg)
    if not problems:  # the stages import the plugins: only once they import cleanly
        stage_problems, cfg = check_stages(cfg, raw or {})
        problems += stage_problems
    checkpoint = check_checkpoint(cfg)
    problems += checkpoint
    if not checkpoint:  # NOTE: a bad stage or seed must not hide a workload that cannot fit
        lengths = request_lengths_or_problems(cfg, problems)
        if lengths is not None:
            problems += check_fits(cfg, *lengths)
            if kind == "execute":
                problems += check_host_memory(cfg, *lengths)
    if problems:
        raise ConfigError(problems)
    return cfg


# ------------------------------------------------------------------------------ features
def feature_problems(cfg: Any) -> list[Problem]:
    """The rules each feature knows of its own limits (tensor parallel splits, devices, CUDA
    graphs, experts, what a simulation can price), beside the config's cross-field rules."""
    from pcpflow.rank.cudagraph import cudagraph_problems
    from pcpflow.rank.devices import device_problems
    from pcpflow.models import ModelCard
    from pcpflow.parallel.moe_dispatch import moe_problems

    p = [] if cfg.grid.problems() else tensor_parallel_problems(cfg)
    p += device_problems(cfg) + cudagraph_problems(cfg) + moe_problems(cfg)
    if cfg.mode == "simulate" or isinstance(cfg.model, ModelCard):
        from pcpflow.simulate.prepare import simulate_problems

        p += simulate_problems(cfg)
    return p


def tensor_parallel_problems(cfg: Any) -> list[Problem]:
    """``tp_problems`` of a run: its target model and its drafter's layers."""
    from pcpflow.speculative.drafting import MLALayerConfig
    from pcpflow.parallel.tensor_parallel import model_shape, tp_problems

    if cfg.tp == 1:
        return []
    if cfg.dcp > 1 and cfg.grid.dcp_tp > 1:
        rest = (cfg.pipeline.get("forward") or {}).get("dcp_rest")
        if rest == "context":
            return [
                Problem(
                    "pipeline.forward.dcp_rest",
                    rest,
                    f"the context path needs DCP inside PCP only; dcp={cfg.dcp} spans "
                    f"{cfg.grid.dcp_tp} TP ranks: use queries or auto",
                )
            ]
    try:
        heads, kv, inner = model_shape(cfg.model)
    except ValueError:
        return []  # the model's own validation reports an unreadable checkpoint
    p = tp_problems(cfg.grid, num_heads=heads, num_kv_heads=kv, intermediate_size=inner)
    draft = cfg.draft_stage_config()
    if draft.get("kind") in ("mtp", "dspark"):
        layer = MLALayerConfig.model_validate(draft.get("layer") or {})
        p += tp_problems(
            cfg.grid,
            num_heads=layer.num_heads,
            num_kv_heads=None,
            intermediate_size=layer.intermediate_size,
            what="the drafter (draft.layer)",
        )
    return p


# ------------------------------------------------------------------------------ stages
def check_plugins(cfg: Any) -> list[Problem]:
    """Each plugin module imports: any error it raises at import (a SyntaxError, a
    NameError, an ImportError of its own) is its problem, named with the module."""
    from pcpflow.pipeline.stage import import_plugins

    problems = []
    for i, name in enumerate(cfg.plugins):
        try:
            import_plugins([name])
        except ModuleNotFoundError as exc:
            if exc.name and name.startswith(exc.name):
                problems.append(Problem(f"plugins[{i}]", name, "an importable module (it is not on sys.path / PYTHONPATH)"))
            else:
                problems.append(Problem(f"plugins[{i}]", name, f"a module that imports; importing it failed: {_short(exc)}"))
        except Exception as exc:  # noqa: BLE001 - a user module may raise anything at import
            problems.append(Problem(f"plugins[{i}]", name, f"a module that imports; importing it failed: {_short(exc)}"))
    return problems


def check_stages(cfg: Any, raw: dict[str, Any]) -> tuple[list[Problem], Any]:
    """The pipeline's problems, and ``cfg`` with ``num_speculative_tokens`` taken from its
    draft stage (the scheduler must reserve exactly what the stage will propose)."""
    from pcpflow.pipeline.assemble import num_speculative_tokens, resolve_pipeline

    try:
        k = num_speculative_tokens(resolve_pipeline(cfg))
    except ConfigError as exc:
        return exc.problems, cfg
    given = raw.get("num_speculative_tokens")
    if given is not None and given != k:
        problem = Problem("num_speculative_tokens", given, f"derived from the draft stage ({k}); set draft.num_speculative_tokens")
        return [problem], cfg
    return [], cfg.model_copy(update={"num_speculative_tokens": k})


def _short(exc: BaseException) -> str:
    if isinstance(exc, SyntaxError):
        return f"SyntaxError: {exc.msg} ({exc.filename}, line {exc.lineno})"
    return f"{type(exc).__name__}: {exc}"


# ------------------------------------------------------------------------------ seeds
def check_seeds(cfg: Any) -> list[Problem]:
    lo, hi = SEED_RANGE
    problems = []
    for field, value in _seeds(cfg):
        if value is not None and not lo <= int(value) <= hi:
            problems.append(Problem(field, value, "an integer in [-2**63, 2**63 - 1] (what the RNGs take)"))
    return problems


def _seeds(cfg: Any) -> list[tuple[str, Any]]:
    out = [("seed", cfg.seed), ("workload.seed", getattr(cfg.workload, "seed", None))]
    sampling = getattr(cfg, "sampling", None)
    if sampling is not None:
        out.append(("sampling.seed", getattr(sampling, "seed", None)))
    return out


# ------------------------------------------------------------------------------ workload
def request_lengths_or_problems(cfg: Any, problems: list[Problem]) -> tuple[np.ndarray, np.ndarray] | None:
    from pcpflow.scheduling.workload import request_lengths

    try:
        return request_lengths(cfg.workload, seed=cfg.seed, vocab_size=_vocab_size(cfg))
    except ConfigError as exc:
        problems += exc.problems
        return None


def _vocab_size(cfg: Any) -> int:
    from pcpflow.models import vocab_size_of

    return vocab_size_of(cfg.model)


def check_fits(cfg: Any, prompt_lens: np.ndarray, output_lens: np.ndarray) -> list[Problem]:
    """Every request's reservation fits the whole KV cache (else it would wait forever)."""
    spec = cfg.num_speculative_tokens
    tokens_per_block = cfg.kv.block_size * cfg.dcp
    need = -(-(prompt_lens.astype(np.int64) + output_lens + spec) // tokens_per_block)
    bad = np.flatnonzero(need > cfg.kv.num_blocks)
    problems = []
    for i in bad[:5]:
        problems.append(
            Problem(
                "kv.num_blocks",
                cfg.kv.num_blocks,
                f"workload request {i} needs {need[i]} blocks ({prompt_lens[i]} prompt + {output_lens[i]} output + "
                f"{spec} speculative tokens at {tokens_per_block} tokens per block); kv.num_blocks must be >= {need[i]}",
            )
        )
    if len(bad) > 5:
        problems.append(Problem("kv.num_blocks", cfg.kv.num_blocks, f"... and {len(bad) - 5} more requests do not fit; the largest needs {max(need)} blocks"))
    return problems


# ------------------------------------------------------------------------------ host memory
def check_host_memory(cfg: Any, prompt_lens: np.ndarray, output_lens: np.ndarray) -> list[Problem]:
    """An executed run's allocations on this host (every rank of it, and the reference on
    rank 0) fit in its available memory. Each size that alone is too big is named."""
    available = host_memory_bytes()
    if available is None:
        return []
    budget = int(available * HOST_MEMORY_FRACTION)
    ranks = cfg.world_size + (1 if cfg.verify else 0)  # the reference keeps a full cache
    entry_bytes, hidden_bytes = _kv_entry_bytes(cfg)
    sizes = {
        "kv.num_blocks": ranks * cfg.kv.num_blocks * cfg.kv.block_size * entry_bytes,
        "scheduler.max_num_batched_tokens": ranks * cfg.scheduler.max_num_batched_tokens * (_BUFFER_BYTES_PER_TOKEN + 4 * hidden_bytes),
        "scheduler.max_num_seqs": ranks * cfg.scheduler.max_num_seqs * _BUFFER_BYTES_PER_SEQ,
        "workload": ranks * 3 * 8 * int(prompt_lens.sum() + output_lens.sum()),  # token ids: requests, scheduler
    }
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
        problems.append(Problem("kv.num_blocks", cfg.kv.num_blocks, f"a run that fits this host: KV caches, buffers and workload together need {_gib(total)}, {_gib(budget)} is available"))
    return problems


def _given(cfg: Any, field: str) -> Any:
    if field == "workload":
        return getattr(cfg.workload, "path", None) or cfg.workload.kind
    section, key = field.split(".")
    return getattr(getattr(cfg, section), key)


def _kv_entry_bytes(cfg: Any) -> tuple[int, int]:
    """(bytes of one token's KV entries over all layers, bytes of one hidden row), from the
    model built on the meta device (no memory, no weights read)."""
    import torch

    from pcpflow.pipeline.context import DTYPES
    from pcpflow.models import build_model

    dtype = DTYPES[cfg.dtype]
    try:
        model = build_model(cfg.model, dtype=dtype, seed=0, device="meta")
    except Exception:  # a model that cannot be built on meta: price it as 1 kB per layer
        return 1024, 1024
    size = torch.empty((), dtype=dtype).element_size()
    return model.num_layers * model.attn_spec.entry_dim * size, model.hidden_size * size


def host_memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


# ------------------------------------------------------------------------------ checkpoint
def check_checkpoint(cfg: Any) -> list[Problem]:
    """A Hugging Face checkpoint's safetensors files are whole, are safetensors, and hold
    tensors of the shapes its config.json implies: all from the headers (a few kB each)."""
    if getattr(cfg.model, "name", None) != "hf" or not cfg.model.path:
        return []
    from pcpflow.errors import missing_extra
    from pcpflow.models.hf_weights import checkpoint_files
    from pcpflow.tokens.text import has_tokenizer

    missing = missing_extra(("safetensors", *(("transformers",) if has_tokenizer(cfg.model) else ())), "hf")
    if missing:
        return [Problem("model", "hf", f"a checkpoint needs {missing}")]

    path = Path(cfg.model.path)
    try:
        files = checkpoint_files(path)
    except (ValueError, OSError) as exc:
        return [Problem("model.path", str(path), str(exc))]
    problems, shapes = [], {}
    for f in files:
        try:
            header = read_safetensors_header(f)
        except ValueError as exc:
            problems.append(Problem("model.path", str(f), f"a whole safetensors file; {exc}"))
            continue
        shapes.update({k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"})
    if problems:
        return problems
    return _shape_problems(cfg, path, shapes)


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file; ValueError if the file is not safetensors or
    is shorter than its header says (truncated)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path.name} has {size} bytes: too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 100 * 2**20):
            raise ValueError(f"{path.name} is not safetensors (its first 8 bytes give a header of {n} bytes; the file has {size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError(f"{path.name} is not safetensors (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path.name} is not safetensors (its header is not a JSON object)")
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)), default=0)
    if 8 + n + end > size:
        raise ValueError(f"{path.name} is truncated: its header says {8 + n + end} bytes, the file has {size}")
    return header


def _shape_problems(cfg: Any, path: Path, shapes: dict[str, tuple[int, ...]]) -> list[Problem]:
    """Tensors whose shape differs from the parameter config.json gives them."""
    from pcpflow.models.common import build_uninitialized
    from pcpflow.models.hf import HFModel, read_checkpoint

    try:
        checkpoint = read_checkpoint(path)
        model = build_uninitialized(lambda: HFModel(checkpoint), "meta")
    except Exception:  # config.json problems are the model's own validation's to report
        return []
    params = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    problems = []
    for hf_name, shape in shapes.items():
        for rename in checkpoint.renames:
            m = rename.pattern().fullmatch(hf_name)
            if m is None:
                continue
            ours = rename.ours.replace("{i}", m.groupdict().get("i") or "").replace("{wb}", m.groupdict().get("wb") or "")
            want = params.get(ours)
            if want is not None and rename.part is not None:
                want = (want[0] // rename.part[1], *want[1:])
            if want is not None and tuple(shape) != want:
                problems.append(Problem("model.path", str(path), f"tensor {hf_name} has shape {list(shape)}; config.json implies {list(want)}"))
            break
    return problems[:10]


# ------------------------------------------------------------------------------ run dir, ranks
def check_run_dir(run_dir: Path, *, create: bool = True) -> None:
    """The run dir is a directory this process can create and write (``create=False``:
    could create, without creating it: nothing may appear for an invalid command)."""
    problem = None
    if run_dir.exists() and not run_dir.is_dir():
        problem = "a directory; it is an existing file"
    elif not create:
        parent = next(p for p in (run_dir, *run_dir.parents) if p.exists())
        if not parent.is_dir():
            problem = f"a directory pcpflow can create; {parent} is a file"
        elif not os.access(parent, os.W_OK | os.X_OK):
            problem = f"a directory pcpflow can create; {parent} is not writable"
    else:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            probe = run_dir / f".pcpflow-write-probe-{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as exc:
            problem = f"a directory pcpflow can create and write; {exc.strerror or exc}"
    if problem:
        raise ConfigError([Problem("hydra.run.dir", str(run_dir), problem)])


def capacity_warnings(cfg: Any) -> list[str]:
    """More ranks than this machine can reasonably run at once: they still run, slowly. A
    simulated run starts no ranks."""
    if getattr(cfg, "mode", "execute") == "simulate":
        return []
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    want = cfg.world_size * cfg.threads_per_rank
    device = getattr(cfg, "device", "auto")
    if device != "cpu":
        try:
            import torch

            if torch.cuda.is_available():
                gpus = torch.cuda.device_count()
                return [] if cfg.world_size <= gpus else [f"tp*pcp = {cfg.world_size} ranks on {gpus} GPU(s): ranks share devices"]
        except Exception:
            pass
    if want > 4 * cores:
        return [
            f"tp*pcp = {cfg.world_size} ranks x threads_per_rank={cfg.threads_per_rank} on {cores} CPU core(s): "
            f"the run will be slow (each rank gets {cores / want:.2f} core); step times do not measure the layout"
        ]
    return []
