"""The layouts a search walks, each written as the command line writes it.

A layout is a value per dimension (``DIMS``): tp, pcp, dcp, the decode mode, the DCP path of
the rest rows (``pipeline.forward.dcp_rest``), the CP attention variant
(``pipeline.forward.cp_attention``), MoE dispatch, the CUDA-graph mode, the pools (one pool,
or prefill/decode pools: ``pool_dims``, ``disagg=pd`` with the decode pool's grid) and the
replicas that fill ``search.gpus`` (an instance with pools is not replicated). A dimension given on the command line (not null in ``mode=search``)
is fixed; the others are enumerated.

The space holds each distinct layout once: a setting that changes nothing in a layout takes
its default there (``canonical``): sharded decodes need pcp > 1; ``dcp_rest`` chooses between
DCP paths only when DCP runs inside PCP with the all-gather path; Meta's rings need
dcp = pcp > 1 and run in one pool only; MoE dispatch needs experts, and ``gather`` needs
pcp > 1; with pools the decode mode is the decode pool's. What remains and
cannot run (heads, memory, the grid's rules) is pruned by validation, with its reason
(``pcpflow.search.plan``).
"""

from __future__ import annotations

import itertools
import shlex
from dataclasses import dataclass
from typing import Any

from pcpflow.errors import Problem
from pcpflow.parallel.grid import RankGrid


@dataclass(frozen=True)
class Dim:
    """One dimension: its column in search.csv, its key on the command line, where the
    composed config holds it, the value a candidate that leaves it out gets, and the values
    the space enumerates."""

    name: str
    key: str
    path: tuple[str, ...]
    default: Any
    values: tuple[Any, ...] = ()


CUDAGRAPH_MODES = ("none", "piecewise", "full_decode_only", "full_and_piecewise", "full")
DCP_RESTS = ("auto", "queries", "context")
CP_ATTENTIONS = ("allgather", "ring_pass_kv", "ring_pass_q", "ring_auto")
MOE_DISPATCHES = ("local", "gather", "all_to_all")

DIMS: tuple[Dim, ...] = (
    Dim("tp", "tp", ("tp",), 1),
    Dim("pcp", "pcp", ("pcp",), 1),
    Dim("dcp", "dcp", ("dcp",), 1),
    Dim("decode", "decode", ("decode", "mode"), "replicated", ("replicated", "sharded")),
    Dim("dcp_rest", "pipeline.forward.dcp_rest", ("pipeline", "forward", "dcp_rest"), "auto", DCP_RESTS),
    Dim("cp_attention", "pipeline.forward.cp_attention", ("pipeline", "forward", "cp_attention"), "allgather",
        CP_ATTENTIONS),
    Dim("moe_dispatch", "moe.dispatch", ("moe", "dispatch"), None, MOE_DISPATCHES),
    Dim("cudagraph_mode", "cudagraph_mode", ("cudagraph_mode",), "none", CUDAGRAPH_MODES),
)
REPLICAS = Dim("replicas", "serving.replicas", ("serving", "replicas"), None)
ALIASES = {"decode.mode": "decode", "dcp_rest": "dcp_rest", "cp_attention": "cp_attention",
           "replicas": "replicas", "disagg.kind": "disagg"}
"""Other spellings a candidate string may use for a dimension's key."""


def pool_dims(pools_available: bool) -> tuple[Dim, ...]:
    """The pools dimensions, where the config has prefill/decode disaggregation: one pool or
    ``disagg=pd``, and the decode pool's grid (``disagg.decode_pool.{tp,pcp,dcp}``). ``Space``
    enumerates them after ``DIMS``; an instance is both pools' GPUs."""
    if not pools_available:
        return ()
    return (
        Dim("disagg", "disagg", ("disagg", "kind"), "none", ("none", "pd")),
        Dim("decode_pool_tp", "disagg.decode_pool.tp", ("disagg", "decode_pool", "tp"), 1),
        Dim("decode_pool_pcp", "disagg.decode_pool.pcp", ("disagg", "decode_pool", "pcp"), 1),
        Dim("decode_pool_dcp", "disagg.decode_pool.dcp", ("disagg", "decode_pool", "dcp"), 1),
    )


@dataclass(frozen=True)
class Layout:
    """One candidate: a value per dimension (``Space.dims`` order, replicas last) and any
    other key its candidate string set (``extra``, as written)."""

    values: tuple[tuple[str, Any], ...]
    extra: tuple[tuple[str, Any], ...] = ()

    def __getitem__(self, name: str) -> Any:
        return dict(self.values)[name]

    def get(self, name: str, default: Any = None) -> Any:
        return dict(self.values).get(name, default)

    @property
    def world(self) -> int:
        """GPUs of one instance: tp x pcp, and the decode pool's when there is one."""
        v = dict(self.values)
        pool = v["decode_pool_tp"] * v["decode_pool_pcp"] if v.get("disagg") == "pd" else 0
        return v["tp"] * v["pcp"] + pool

    @property
    def gpus(self) -> int:
        return self.world * (self["replicas"] or 1)

    def overrides(self, dims: tuple[Dim, ...], *, every: bool = False) -> list[str]:
        """The layout on the command line: tp, pcp, dcp always, the rest where it is not the
        default (``every``: all of them)."""
        out = []
        for d in (*dims, REPLICAS):
            value = self[d.name]
            if d.name in ("tp", "pcp", "dcp") or every or value != _shown_default(d):
                if d.name.startswith("decode_pool") and self.get("disagg") != "pd":
                    continue
                out.append(f"{d.key}={_text(value)}")
        out += [f"{k}={_text(v)}" for k, v in self.extra]
        return out

    def label(self, dims: tuple[Dim, ...]) -> str:
        return " ".join(self.overrides(dims))


def _shown_default(d: Dim) -> Any:
    return 1 if d.name == "replicas" else d.default


def _text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_text(v) for v in value) + "]"
    return str(value)


def powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


class Space:
    """The layouts of ``gpus`` GPUs. ``fixed``: dimension name -> the value given on the
    command line (others enumerated). ``experts``: the model has MoE layers. ``fill``:
    replicas fill the GPUs (the workload arrives in time, or can: see ``plan``); else one."""

    def __init__(self, gpus: int, *, fixed: dict[str, Any], experts: bool, fill: bool,
                 pools_available: bool = False) -> None:
        self.gpus, self.fixed, self.experts, self.fill = gpus, dict(fixed), experts, fill
        self.pools = pools_available
        self.dims = DIMS + pool_dims(pools_available)

    # -- enumeration --------------------------------------------------------------------------

    def enumerate(self, gpus: int | None = None) -> list[Layout]:
        """Every distinct layout whose instance's GPUs divide ``gpus`` (``search.candidates``
        asks for others), smallest first."""
        gpus = self.gpus if gpus is None else gpus
        seen: dict[tuple, Layout] = {}
        for base in self._skeletons(gpus):
            for values in self._variants(base):
                layout = self.canonical(values, gpus)
                if layout is not None and layout.values not in seen:
                    seen[layout.values] = layout
        return sorted(seen.values(), key=lambda lay: (lay.world, lay["tp"], lay["pcp"], lay["dcp"]))

    def up_to(self, gpus: int) -> list[Layout]:
        """Every distinct layout whose instance has at most ``gpus`` GPUs, whether or not they
        divide ``gpus``, on grids the grid's rules allow (``RankGrid``): the layouts of every
        GPU count up to ``gpus`` at once, each once, smallest first."""
        seen: dict[tuple, Layout] = {}
        for base in self._skeletons(gpus, divides=False):
            if RankGrid(base["tp"], base["pcp"], base["dcp"]).problems():
                continue
            for values in self._variants(base):
                pool = (values.get("decode_pool_tp", 1), values.get("decode_pool_pcp", 1),
                        values.get("decode_pool_dcp", 1))
                if values.get("disagg") == "pd" and RankGrid(*pool).problems():
                    continue
                layout = self.canonical(values, gpus)
                if layout is not None and layout.values not in seen:
                    seen[layout.values] = layout
        return sorted(seen.values(), key=lambda lay: (lay.gpus, lay.world, lay["tp"], lay["pcp"], lay["dcp"]))

    def _skeletons(self, gpus: int, *, divides: bool = True):
        """(tp, pcp, dcp) whose GPUs divide ``gpus`` (replicas fill them; ``divides=False``:
        at most ``gpus``): tp a power of two, dcp by the grid's rules (1, pcp, tp*pcp; pcp=1:
        the divisors of tp)."""
        tps = [self.fixed["tp"]] if "tp" in self.fixed else powers_of_two(gpus)
        for tp in tps:
            pcps = ([self.fixed["pcp"]] if "pcp" in self.fixed
                    else [p for p in range(1, gpus // max(tp, 1) + 1) if not divides or gpus % (tp * p) == 0])
            for pcp in pcps:
                if "dcp" in self.fixed:
                    dcps = [self.fixed["dcp"]]
                elif pcp > 1:
                    dcps = sorted({1, pcp, tp * pcp})
                else:
                    dcps = [d for d in range(1, tp + 1) if tp % d == 0]
                for dcp in dcps:
                    yield {"tp": tp, "pcp": pcp, "dcp": dcp}

    def _variants(self, base: dict[str, Any]):
        rest = [d for d in self.dims if d.name not in base and not d.name.startswith("decode_pool")]
        choices = []
        for d in rest:
            if d.name in self.fixed:
                choices.append([self.fixed[d.name]])
            elif d.name == "moe_dispatch":
                choices.append(list(d.values) if self.experts else [None])
            else:
                choices.append(list(d.values))
        for combo in itertools.product(*choices):
            values = {**base, **dict(zip((d.name for d in rest), combo))}
            if values.get("disagg") != "pd":
                yield values
                continue
            for pool in self._decode_pools(base["tp"] * base["pcp"]):
                yield {**values, **pool}

    def _decode_pools(self, prefill_gpus: int):
        """The decode pool's grids beside a prefill pool of ``prefill_gpus`` GPUs: tp a power
        of two, pcp 1 (a decode pool recomputes no prefill it could shard), dcp dividing tp,
        both pools within ``search.gpus``; what the command line fixed stays."""
        left = self.gpus - prefill_gpus
        tps = [self.fixed["decode_pool_tp"]] if "decode_pool_tp" in self.fixed else powers_of_two(max(left, 0))
        pcps = [self.fixed["decode_pool_pcp"]] if "decode_pool_pcp" in self.fixed else [1]
        for tp in tps:
            for pcp in pcps:
                dcps = ([self.fixed["decode_pool_dcp"]] if "decode_pool_dcp" in self.fixed
                        else [d for d in range(1, tp + 1) if tp % d == 0] if pcp == 1 else sorted({1, pcp, tp * pcp}))
                for dcp in dcps:
                    yield {"decode_pool_tp": tp, "decode_pool_pcp": pcp, "decode_pool_dcp": dcp}

    def canonical(self, values: dict[str, Any], gpus: int | None = None) -> Layout | None:
        """The layout ``values`` stand for, each setting that changes nothing at its default,
        replicas filled; None when the values name no layout the space holds (a ring without
        dcp = pcp > 1, an instance larger than ``gpus``)."""
        gpus = self.gpus if gpus is None else gpus
        v = {d.name: values.get(d.name, d.default) for d in self.dims}
        pcp, dcp = v["pcp"], v["dcp"]
        pools = v.get("disagg", "none") == "pd"
        # NOTE: with pools the decode mode is the decode pool's (the prefill pool runs prefills only)
        if (v["decode_pool_pcp"] if pools else pcp) == 1:
            v["decode"] = self._unless_fixed("decode", "replicated", v)
        ring = v["cp_attention"] != "allgather"
        if ring and not (pcp > 1 and dcp == pcp) and "cp_attention" not in self.fixed:
            return None
        if not (dcp > 1 and pcp > 1 and dcp == pcp) or ring:
            v["dcp_rest"] = self._unless_fixed("dcp_rest", "auto", v)
        if v["moe_dispatch"] is not None:
            if not self.experts:
                v["moe_dispatch"] = self._unless_fixed("moe_dispatch", None, v)
            elif pcp == 1 and v["moe_dispatch"] == "gather":
                v["moe_dispatch"] = self._unless_fixed("moe_dispatch", "local", v)
        if not pools:
            for name in ("decode_pool_tp", "decode_pool_pcp", "decode_pool_dcp"):
                if name in v:
                    v[name] = 1
        layout = self.layout(v, values.get("replicas"), gpus)
        return None if layout.world > gpus else layout

    def layout(self, values: dict[str, Any], replicas: int | None = None, gpus: int | None = None,
               extra: tuple[tuple[str, Any], ...] = ()) -> Layout:
        """The layout of ``values`` as given (defaults for what they leave out); replicas
        fill ``gpus`` unless given."""
        v = tuple((d.name, values.get(d.name, d.default)) for d in self.dims)
        world = Layout(v + (("replicas", 1),)).world
        if replicas is None:
            replicas = self.fixed.get("replicas")
        if replicas is None:  # NOTE: one prefill and one decode pool per instance: pools are not replicated
            pools = values.get("disagg") == "pd"
            replicas = max(1, (self.gpus if gpus is None else gpus) // world) if self.fill and not pools else 1
        return Layout(v + (("replicas", replicas),), extra)

    def _unless_fixed(self, name: str, value: Any, v: dict[str, Any]) -> Any:
        return v[name] if name in self.fixed else value

    # -- candidate strings --------------------------------------------------------------------

    def candidates(self, strings: list[str]) -> tuple[list[Layout], list[Problem]]:
        """``search.candidates``: each string the overrides of one layout (``a,b`` sweeps a
        key, as on the command line); a dimension a string leaves out takes the command
        line's value, else its default (tp, pcp, dcp: 1). Other keys are kept as written
        (``extra``) and validated with the layout."""
        from hydra.core.override_parser.overrides_parser import OverridesParser

        parser = OverridesParser.create()
        names = {d.key: d.name for d in (*self.dims, REPLICAS)} | ALIASES
        out: list[Layout] = []
        problems: list[Problem] = []
        for i, text in enumerate(strings):
            field = f"search.candidates[{i}]"
            try:
                parsed = parser.parse_overrides(shlex.split(str(text)))
            except Exception as exc:  # noqa: BLE001 (Hydra raises several types for one bad string)
                problems.append(Problem(field, text, f"overrides as on the command line ('tp=8 pcp=4'): "
                                                     f"{str(exc).strip().splitlines()[0]}"))
                continue
            options: list[list[tuple[str, Any]]] = []
            for o in parsed:
                key = o.get_key_element().lstrip("+~")
                values = ([_value(parser, key, s) for s in o.sweep_string_iterator()] if o.is_sweep_override()
                          else [o.value()])
                if key.split(".")[0] in SEARCH_WIDE:
                    problems.append(Problem(field, text, f"{key} is the whole search's, not a layout's: set it on "
                                            "the command line; a candidate sets layout keys (tp, pcp, dcp, "
                                            "decode.mode, cudagraph_mode, serving.replicas, ...) and per-layout "
                                            "settings (kv.*, scheduler.*, pipeline.*)"))
                    continue
                name = names.get(key)
                clash = [v for v in values if name in self.fixed and v != self.fixed[name]]
                if clash:
                    problems.append(Problem(field, text, f"{key}={clash[0]} contradicts {key}={self.fixed[name]} "
                                            "on the command line, which fixes it for every candidate: drop one"))
                    continue
                options.append([(key, val) for val in values])
            for combo in itertools.product(*options):
                values, extra = dict(self.fixed), []
                for key, val in combo:
                    if key in names:
                        values[names[key]] = val
                    else:
                        extra.append((key, val))
                layout = self.layout(values, values.get("replicas"), extra=tuple(extra))
                if layout not in out:
                    out.append(layout)
        return out, problems

    def from_params(self, params: dict[str, Any]) -> Layout | None:
        """The layout an optimizer's sampled values name (None: none of the space's)."""
        values = {**self.fixed, **params}
        layout = self.canonical(values)
        if layout is None:
            return None
        return layout if all(layout[k] == v for k, v in values.items() if k != "replicas") else None


SEARCH_WIDE = {"mode", "search", "hydra", "model", "hardware", "workload", "slo", "simulate", "seed", "max_steps",
               "output"}
"""Settings that apply to the whole search (every layout alike): no candidate's to set."""


def _value(parser: Any, key: str, text: str) -> Any:
    return parser.parse_override(f"{key}={text}").value()


def set_path(raw: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node = raw
    for part in path[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[path[-1]] = value


def get_path(raw: dict[str, Any], path: tuple[str, ...]) -> Any:
    node: Any = raw
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node
