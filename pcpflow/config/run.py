"""The run configuration: pydantic models, cross-field rules, one report of every problem.

Hydra composes the YAML in the driver; everything after that sees a validated,
frozen ``RunConfig`` built from plain containers (strict pydantic rejects OmegaConf
nodes, so callers convert with ``OmegaConf.to_container(resolve=True)`` first).
"""

from __future__ import annotations

import functools
import re
import typing
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from pcpflow.config.choices import allowed_choices, did_you_mean, parse_expected
from pcpflow.config.disagg import DisaggConfig, disagg_problems, pool_problems
from pcpflow.config.hardware import EntryError, HardwareConfig, SimulateConfig
from pcpflow.config.profile import ProfileConfig
from pcpflow.errors import ConfigError, Problem, Settings
from pcpflow.models import ModelConfig
from pcpflow.parallel.grid import RankGrid
from pcpflow.parallel.moe_config import MoERunConfig
from pcpflow.scheduling.workload import WorkloadConfig
from pcpflow.tokens.sampling_config import SamplingConfig
from pcpflow.tokens.text import repetition_penalty_of

BF16_LOGITS_ATOL = 0.25
"""bf16 keeps 8 mantissa bits: a logit of magnitude ~4-8 is only resolved to ~0.03, and a
PCP run rounds in a different order than one rank (other batch shapes, merged shards)."""


class DecodeConfig(Settings):
    mode: Literal["replicated", "sharded"] = Field(
        "replicated",
        description="replicated: every PCP rank holds every decode; sharded: each decode "
        "lives on one rank",
    )
    assignment: Literal["round_robin", "balanced"] = Field(
        "round_robin",
        description="which rank owns each sharded decode: k-th decode on rank k mod P "
        "(vLLM), or balanced by the context each decode reads",
    )


class SchedulerConfig(Settings):
    max_num_batched_tokens: int = Field(128, ge=1, description="token budget of one step")
    max_num_seqs: int = Field(8, ge=1, description="most requests running at once")


class KVConfig(Settings):
    block_size: int = Field(16, ge=1, description="KV slots per physical block")
    num_blocks: int = Field(256, ge=1, description="physical blocks per rank and layer")
    interleave: int = Field(
        1, ge=1, description="DCP interleave: position p lives on DCP rank (p // I) % dcp"
    )
    prefix_caching: bool = Field(
        False,
        description="automatic prefix caching: full blocks found again by the chained hash of their "
        "tokens (vLLM's); false in executed runs, true in simulated ones unless set",
    )
    hybrid: Literal["auto", "on", "off"] = Field(
        "auto",
        description="blocks a windowed layer no longer reads go back to the pool (vLLM's hybrid KV cache "
        "manager: layers in groups of one kind sharing the pool, a table each): auto (on for a model with "
        "windowed layers, unless a drafter beside windowed layers only keeps every block) | on "
        "(refused with that) | off (every layer keeps every block)",
    )


class ServingConfig(Settings):
    """Copies of the instance behind a router (simulated runs)."""

    replicas: int = Field(1, ge=1, description="copies of the tp x pcp instance, each with its own KV cache")
    router: Literal["round_robin", "least_loaded", "prefix_aware"] = Field(
        "round_robin",
        description="where an arriving request goes: in turn; to the replica with the fewest queued "
        "plus running tokens; to the one holding its longest cached prefix (ties: least loaded)",
    )


class SLOConfig(Settings):
    """Latency targets a request must meet to count in ``metrics.goodput``."""

    ttft_s: float | None = Field(None, gt=0, description="time to first token, seconds; null: no target")
    tpot_s: float | None = Field(
        None, gt=0, description="time per output token after the first, seconds (a one-token request "
        "meets it); null: no target",
    )
    attainment: float = Field(
        0.9, gt=0, le=1, description="mode=search: the share of requests that must meet every SLO at the "
        "request rate goodput_per_gpu searches for (DistServe's goodput)",
    )


class SearchConfig(Settings):
    """``mode=search``: the layouts for ``search.gpus`` GPUs (``pcpflow.search``, docs/search.md)."""

    gpus: int | None = Field(None, ge=1, description="GPUs to lay out (required in mode=search); replicas "
                             "of a layout fill them")
    candidates: list[str] | None = Field(
        None, description="override strings, one layout each ('tp=8 pcp=4 dcp=4'; a,b sweeps a key), that "
        "restrict the space to a list; null: every layout the space holds",
    )
    top_k: int = Field(20, ge=1, description="the best screened layouts priced in full (whole workload)")
    sample: int | None = Field(
        200, ge=1, description="requests a layout is screened on (the workload's first ones); null: the whole "
        "workload",
    )
    jobs: int | None = Field(None, ge=1, description="worker processes (joblib); null: this machine's cores")
    exhaustive_limit: int = Field(
        4000, ge=1, description="a space of more layouts than this is searched by Optuna instead of enumerated",
    )
    trials: int = Field(256, ge=1, description="layouts Optuna screens when the space is not enumerated")


class VerifyConfig(Settings):
    logits_atol: float | None = Field(
        None,
        gt=0,
        description="largest allowed |logit - reference logit| (and KV difference, and MoE router logit "
        "difference); None: 1e-9 in float64, 1e-4 in float32, 0.25 in bfloat16",
    )


class OutputConfig(Settings):
    plots: bool = Field(True, description="write PNG plots next to result.json")
    progress: bool = Field(True, description="show a progress bar on the console")
    save_logits: bool = Field(
        False,
        description="record every sampled logit row per request in result.json 'logits' "
        "(for parity checks; large for big vocabularies)",
    )


def draft_slot(draft: dict[str, Any] | None, pipeline: dict[str, Any] | None) -> dict[str, Any]:
    """The draft slot's settings: the ``draft`` group, with ``pipeline.draft``'s set ones on top."""
    merged = dict(draft or {})
    merged.update({k: v for k, v in ((pipeline or {}).get("draft") or {}).items() if v is not None})
    return merged


class RunConfig(Settings):
    """Everything one pcpflow run needs; see conf/config.yaml for the defaults."""

    pcp: int = Field(2, ge=1, description="prefill context parallel size (PCP ranks)")
    dcp: int = Field(1, ge=1, description="decode context parallel size (KV shards)")
    tp: int = Field(1, ge=1, description="tensor parallel size (heads and MLP width split)")
    seed: int = Field(0, description="seed of model weights and synthetic workloads")
    dtype: Literal["float32", "float64", "bfloat16"] = Field(
        "float64", description="model dtype (bfloat16 accumulates attention and norms in float32)"
    )
    verify: bool = Field(True, description="compare against the single-rank reference")
    warmup: bool = Field(
        True,
        description="executed runs: one throwaway request through the run's own stages before the run clock "
        "starts (vLLM's start-up dummy run), so that first-call costs (op set-up, allocations, NCCL "
        "communicators) are not counted in the first step; skipped when a stage is not pcpflow's own",
    )
    plugins: list[str] = Field(default_factory=list, description="modules with user stages")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda if present")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="collective backend; auto: nccl on cuda, else gloo"
    )
    threads_per_rank: int = Field(
        1,
        ge=1,
        description="torch threads of each rank (also of the in-process rank at pcp=1), so "
        "that layouts are compared on equal terms",
    )
    cpu_bind: Literal["none", "cores"] = Field(
        "none",
        description="cores: each rank's threads run on cores of their own (the r-th rank of a node "
        "on its r-th group of threads_per_rank cores), when the node's ranks fit the cores this job "
        "may use; none: the OS places them",
    )
    collective_timeout_s: float = Field(
        60.0, gt=0, description="a collective waiting longer fails the job"
    )
    startup_timeout_s: float = Field(
        600.0,
        gt=0,
        description="ranks that finished start-up (model load, reference build) wait this long for "
        "the others; a rank not done by then is named and the job fails",
    )
    dcp_comm_backend: Literal["ag_rs", "a2a"] = Field(
        "ag_rs",
        description="DCP over TP ranks: ag_rs (vLLM: all-gather the log-sum-exps, "
        "reduce-scatter the outputs) or a2a (all-to-all of packed partials)",
    )
    max_steps: int | None = Field(None, ge=1, description="stop after this many steps")
    # --- CUDA graphs (pcpflow.rank.cudagraph)
    cudagraph_mode: Literal["none", "piecewise", "full_decode_only", "full_and_piecewise", "full"] = Field(
        "none",
        description="vLLM's CUDA-graph modes: steps are padded to a capture size and "
        "dispatched; full decode steps are captured on CUDA at world size 1",
    )
    cudagraph_capture_sizes: list[int] | None = Field(
        None,
        description="rank-local token counts a step is padded up to; None: vLLM's "
        "default list (1, 2, 4, 8..248 by 8, 256.. by 16, up to min(2*max_num_seqs, 512))",
    )
    decode: DecodeConfig = Field(default_factory=DecodeConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    kv: KVConfig = Field(default_factory=KVConfig)
    model: ModelConfig
    workload: WorkloadConfig
    draft: dict[str, Any] = Field(
        default_factory=lambda: {"kind": "none"},
        description="the draft stage's settings (draft=none|mtp|dspark|self)",
    )
    pipeline: dict[str, Any] = Field(
        default_factory=dict,
        description="stage of each slot ({kind: ...}) and `extra` user stages",
    )
    verify_options: VerifyConfig = Field(default_factory=VerifyConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)
    num_speculative_tokens: int = Field(
        0,
        ge=0,
        description="derived, not a setting: drafts per request and step of the draft stage, "
        "filled when the pipeline is assembled (set draft.num_speculative_tokens instead)",
        json_schema_extra={"derived": True},
    )
    moe: MoERunConfig = Field(default_factory=MoERunConfig)
    serving: ServingConfig = Field(default_factory=ServingConfig)
    slo: SLOConfig = Field(default_factory=SLOConfig)
    disagg: DisaggConfig = Field(default_factory=DisaggConfig)
    # --- simulate (pcpflow.simulate, docs/simulate.md), search (pcpflow.search, docs/search.md)
    mode: Literal["execute", "simulate", "profile", "search"] = Field(
        "execute",
        description="execute: ranks compute (verified); simulate: price every step on `hardware`; profile: "
        "measure this machine on the run's ranks into <run dir>/hardware.yaml; search: the best layouts for "
        "search.gpus GPUs",
    )
    search: SearchConfig = Field(default_factory=SearchConfig)
    simulate: SimulateConfig = Field(default_factory=SimulateConfig)
    profile: ProfileConfig = Field(default_factory=ProfileConfig)
    hardware: HardwareConfig | None = Field(
        None, description="the hardware profile a simulated run prices on (hardware=measured hardware.path=FILE: "
        "one mode=profile measured)")

    @property
    def grid(self) -> RankGrid:
        """The rank grid of the top-level sizes (with ``disagg=pd``: the prefill pool's)."""
        return RankGrid(tp=self.tp, pcp=self.pcp, dcp=self.dcp)

    @property
    def sampling_seed(self) -> int:
        """The seed of the sampling draws: ``sampling.seed``, else the run's ``seed``."""
        return self.seed if self.sampling.seed is None else self.sampling.seed

    @property
    def repetition_penalty(self) -> float:
        """The repetition penalty the run applies: ``sampling.repetition_penalty``, else the
        checkpoint's (``pcpflow.tokens.text.repetition_penalty_of``; 1 = off)."""
        given = self.sampling.repetition_penalty
        return repetition_penalty_of(self.model) if given is None else given

    @property
    def world_size(self) -> int:
        """Every rank of the job: tp x pcp, and with ``disagg=pd`` the decode pool's ranks after them."""
        extra = self.disagg.decode_grid.world_size if self.disagg.enabled else 0
        return self.grid.world_size + extra

    @property
    def shard_decodes(self) -> bool:
        return self.decode.mode == "sharded"

    @property
    def draft_enabled(self) -> bool:
        return self.draft_stage_config().get("kind", "none") != "none"

    def draft_stage_config(self) -> dict[str, Any]:
        """The draft slot's config: the ``draft`` group, with ``pipeline.draft`` on top."""
        return draft_slot(self.draft, self.pipeline)

    @property
    def logits_atol(self) -> float:
        if self.verify_options.logits_atol is not None:
            return self.verify_options.logits_atol
        return {"float64": 1e-9, "float32": 1e-4, "bfloat16": BF16_LOGITS_ATOL}[self.dtype]


def pydantic_problems(exc: ValidationError, prefix: str = "", model: type[BaseModel] | None = None) -> list[Problem]:
    """Turn pydantic errors into Problems named by dotted field path."""
    problems = []
    for err in exc.errors(include_url=False):
        loc = [str(p) for p in err["loc"] if not _is_union_tag(p)]
        given = err.get("input")
        inner = (err.get("ctx") or {}).get("error")
        if isinstance(inner, EntryError):  # NOTE: the entry at fault, not the whole table around it
            loc += [str(p) for p in inner.loc]
            given = inner.given
        field = ".".join(filter(None, [prefix.rstrip("."), *loc])) or prefix or "<config>"
        if err["type"] == "extra_forbidden":
            allowed = _removed_note(model, loc) or "not a setting here" + _known_keys_hint(model, loc)
        elif err["type"] == "missing":
            allowed = "this setting is required"
            given = "<missing>"
        elif err["type"] in ("bool_type", "bool_parsing"):
            allowed = "allowed: true, false"
        elif err["type"] in ("literal_error", "enum", "union_tag_invalid") and (choices := _choices(err)) is not None:
            if err["type"] == "union_tag_invalid":  # NOTE: the key that picks the section, not the whole section
                key = str(err["ctx"]["discriminator"]).strip("'")
                field, given = f"{field}.{key}", err["ctx"]["tag"]
            allowed = allowed_choices(given, choices)
        elif err["type"] == "list_type":
            allowed = "a list (on the command line: [a, b]; [] for none)"
        else:  # NOTE: a validator's own message, without pydantic's "Value error, " in front
            allowed = err["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
        problems.append(Problem(field, given, allowed))
    return problems


def _choices(err: Any) -> list[Any] | None:
    """The values a fixed-choice error allows (a Literal's, an enum's, a tagged union's tags)."""
    ctx = err.get("ctx") or {}
    return parse_expected(str(ctx.get("expected_tags", ctx.get("expected", ""))))


def _is_union_tag(part: Any) -> bool:
    # pydantic puts the discriminator's value (e.g. 'tiny_mla') into the location of
    # errors inside a tagged union; the user never typed it, so drop it.
    return isinstance(part, str) and part in _union_tags()


@functools.cache
def _union_tags() -> frozenset[str]:
    """The discriminator values of the model and workload unions (``name`` / ``kind``)."""
    tags = set()
    for union, key in ((ModelConfig, "name"), (WorkloadConfig, "kind")):
        for member in typing.get_args(typing.get_args(union)[0]):
            tags.update(typing.get_args(member.model_fields[key].annotation))
    return frozenset(tags)


def _node(model: type[BaseModel] | None, loc: list[str]) -> Any:
    """The model that holds the field at ``loc`` (None when the path leaves the models)."""
    node: Any = model
    for part in loc[:-1]:
        fields = getattr(node, "model_fields", None)
        if not fields or part not in fields:
            return None
        node = fields[part].annotation
        if not (isinstance(node, type) and issubclass(node, BaseModel)):
            return None
    return node


def _removed_note(model: type[BaseModel] | None, loc: list[str]) -> str:
    """A removed setting's note naming what replaced it (a model's ``REMOVED``), or ''."""
    node = _node(model, loc) if loc else None
    return (getattr(node, "REMOVED", None) or {}).get(loc[-1], "") if node is not None else ""


def removed_note(key: str) -> str:
    """What replaced the removed setting ``key`` (dotted, e.g. ``simulate.ring_step_us``), or ''."""
    return _removed_note(RunConfig, key.split("."))


def _known_keys_hint(model: type[BaseModel] | None, loc: list[str]) -> str:
    if model is None or not loc:
        return ""
    node = _node(model, loc)
    keys = sorted(getattr(node, "model_fields", {}))
    if not keys:
        return ""
    return f"{did_you_mean(loc[-1], keys)}; allowed keys: {', '.join(keys)}"


MODE_SETTINGS = {"simulate": ("simulate", "search"), "hardware": ("simulate", "search"),
                 "serving": ("simulate", "search"), "workload.request_rate": ("simulate", "search"),
                 "profile": ("profile",), "search": ("search",), "slo.attainment": ("search",),
                 "verify_options": ("execute",), "output.save_logits": ("execute",)}
"""Settings that only some modes read (a section or a dotted key -> those modes). Set in
another mode they would be silently ignored, so they are refused there."""


def mode_problems(cfg: RunConfig) -> list[Problem]:
    """A setting of another mode than the run's, naming the mode that reads it."""
    p = []
    for name, modes in MODE_SETTINGS.items():
        if cfg.mode in modes:
            continue
        if "." in name:  # a key inside a section: refused when set (away from its default)
            section, key = name.split(".", 1)
            node = getattr(cfg, section)
            value = getattr(node, key, None)
            field = getattr(type(node), "model_fields", {}).get(key)
            default = field.get_default(call_default_factory=True) if field is not None else None
        else:
            value, default = getattr(cfg, name), RunConfig.model_fields[name].get_default(call_default_factory=True)
        if value == default:
            continue
        if isinstance(value, BaseModel) and isinstance(default, BaseModel):  # name the keys set
            keys = [k for k in type(value).model_fields if getattr(value, k) != getattr(default, k)]
            given = {f"{name}.{k}": getattr(value, k) for k in keys}
        else:  # NOTE: a measured profile is what the user typed (hardware=measured), not its name inside
            given = "measured" if getattr(value, "path", None) else getattr(value, "name", value)
        where = " / ".join(f"mode={m}" for m in modes)
        p.append(Problem(name, given, f"a setting of {where}, and this run is mode={cfg.mode}: add {where.split(' / ')[0]} or leave it out"))
    return p


SEED_RANGE = (-(2**63), 2**63 - 1)
"""What every RNG of a run takes: torch.manual_seed wants a 64-bit integer (numpy's
SeedSequence takes the low 64 bits of it)."""


def seed_problems(cfg: RunConfig) -> list[Problem]:
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


def cross_field_problems(cfg: RunConfig) -> list[Problem]:
    """Rules that span fields (the applicable part of vLLM's PCP validate_config, plus
    pcpflow's own)."""
    p: list[Problem] = mode_problems(cfg) + seed_problems(cfg)
    p.extend(pool_problems(cfg, cfg.grid.problems(), "prefill"))
    p.extend(disagg_problems(cfg))
    if cfg.kv.block_size % cfg.kv.interleave:
        p.append(
            Problem(
                "kv.interleave",
                cfg.kv.interleave,
                f"must divide kv.block_size={cfg.kv.block_size}",
            )
        )
    if cfg.decode.assignment == "balanced" and cfg.decode.mode != "sharded":
        p.append(
            Problem(
                "decode.assignment",
                "balanced",
                "'balanced' places sharded decodes; use decode=sharded, or round_robin",
            )
        )
    return p


def parse_run_config(raw: dict[str, Any]) -> RunConfig:
    """Validate a plain dict; raise ConfigError listing every problem."""
    cfg, problems = validate_run_config(raw)
    if problems or cfg is None:
        raise ConfigError(problems)
    return cfg


def validate_run_config(
    raw: dict[str, Any], rules: Callable[[RunConfig], list[Problem]] | None = None
) -> tuple[RunConfig | None, list[Problem]]:
    """The config and every problem of ``raw``: field errors, then the cross-field rules
    (and ``rules``: the features' own, which ``pcpflow.driver.checks`` gathers).

    A bad value does not hide the other problems: the fields in error are set back to their
    defaults and the rest is validated again (cross-field rules that read a field in error
    are left out, as they would judge the default). None when no config could be built."""
    problems: list[Problem] = []
    bad: set[str] = set()
    data = raw
    for _ in range(4):
        try:
            cfg = RunConfig.model_validate(data)
        except ValidationError as exc:
            found = pydantic_problems(exc, model=RunConfig)
            problems += [p for p in found if p.field not in bad and not _echoes(p, bad)]
            salvaged = _without(data, [tuple(str(x) for x in e["loc"]) for e in exc.errors()])
            # NOTE: the fields pydantic named (an entry's problem is its field's: its index would echo everywhere)
            bad |= {".".join(str(x) for x in e["loc"] if not _is_union_tag(x)) or "<config>" for e in exc.errors()}
            if salvaged == data:
                return None, problems
            data = salvaged
            continue
        found = cross_field_problems(cfg) + (rules(cfg) if rules is not None else [])
        problems += [p for p in found if p.field not in bad and not _echoes(p, bad)]
        return cfg, problems
    return None, problems


def _echoes(problem: Problem, bad: set[str]) -> bool:
    """Whether ``problem`` names a field already in error: found once that field fell back to
    its default (``workload.prompt_lens=[]``, then "give prompt_lens or prompts"), it is the
    same problem again."""
    return any(re.search(rf"\b{re.escape(field.rsplit('.', 1)[-1])}\b", problem.allowed) for field in bad)


def _without(raw: dict[str, Any], locs: list[tuple[str, ...]]) -> dict[str, Any]:
    """A copy of ``raw`` without the leaves at ``locs`` (pydantic error locations; a
    union's tag in a location is skipped), so that their defaults apply."""
    out = _copy(raw)
    for loc in locs:
        parts = [p for p in loc if not _is_union_tag(p)]
        if len(parts) < 2 and (not parts or parts[0] in ("model", "workload")):
            continue  # a whole section in error: it has no default to fall back to
        node: Any = out
        for part in parts[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(parts[-1], None)
    return out


def _copy(node: Any) -> Any:
    return {k: _copy(v) for k, v in node.items()} if isinstance(node, dict) else node
