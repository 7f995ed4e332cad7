"""Compose a job's config from ``conf/`` and command-line overrides, and validate it, with
every problem of the command line in one report.

Hydra stops at the first key it cannot place; here such an override is reported and left
out, and composing goes on, so that an unknown key, a bad value and a cross-field error are
reported together. An unknown key gets the closest known one ("did you mean"), and a key
that only another option of its group has names that option (``workload.prompt_lens``:
``workload=explicit``).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pcpflow.config.choices import allowed_choices, closest
from pcpflow.errors import ConfigError, Problem
from pcpflow.paths import conf_dir

if TYPE_CHECKING:
    from pcpflow.config.run import RunConfig

_NOT_HERE = "not a setting here"


def compose_raw(overrides: list[str], *, with_hydra: bool = False) -> dict[str, Any]:
    """Compose conf/config.yaml with overrides into a plain dict (ConfigError on failure)."""
    raw, problems = compose_checked(overrides, with_hydra=with_hydra)
    if problems or raw is None:
        raise ConfigError(problems)
    return raw


def validate_overrides(overrides: list[str]) -> RunConfig:
    """Compose and validate one job as a run does: its config, or ConfigError with every problem.
    Every way a job starts asks here (``python -m pcpflow``, each job of a sweep, rank 0 under
    torchrun), so that a command gets the same words whichever way it is started."""
    from pcpflow.driver.job import prepare_job

    raw, problems = compose_checked(overrides)
    if raw is not None:
        problems = [_without_drafting_in_profile(_with_draft_tokens_hint(p, raw), raw) for p in problems]
    if raw is not None and raw.get("mode") == "search":
        problems += _search_group_problems(overrides)
    # NOTE: a mode that could not be placed leaves mode=execute behind, which would then refuse
    # every setting of the mode meant: what belongs to which mode is judged once it is known
    cfg = None
    if raw is not None and "mode" not in {p.field for p in problems}:
        refused = {p.field for p in problems}
        try:
            cfg = prepare_job(raw)
        except ConfigError as exc:
            # NOTE: an override that could not be placed left its default behind; what the
            # default then breaks is the same problem again (hardware=h100, or a key inside
            # the section, hardware.path without hardware=measured: "no hardware")
            problems += [_with_draft_tokens_hint(p, raw) if p.allowed.startswith(_NOT_HERE) else p
                         for p in exc.problems if p.field not in refused
                         and not any(r.lstrip("+~").startswith(p.field + ".") for r in refused)]
    if problems or cfg is None:
        raise ConfigError([_with_option_hint(p) for p in problems])
    return cfg


SEARCHED_GROUPS = {"decode": "decode.mode", "disagg": "disagg.kind"}
"""Groups whose option sets a key mode=search searches (the group's key -> that key)."""


def with_searched_groups(args: list[str]) -> list[str]:
    """In ``mode=search``, ``decode=sharded`` and ``disagg=pd`` fix what they name, as in a
    candidate string or another mode: they become ``decode.mode=sharded`` / ``disagg.kind=pd``.
    (The group's option would set the key, and mode=search, composed after it, null it again:
    searched. The decode pool's grid stays searched under ``disagg=pd``, as a candidate's.)"""
    if not any(_key(a) == "mode" and a.partition("=")[2] == "search" for a in args):
        return args
    return [f"{SEARCHED_GROUPS[_key(a)]}={a.partition('=')[2]}" if _key(a) in SEARCHED_GROUPS
            and a[:1] not in "+~" and "=" in a else a for a in args]


def _search_group_problems(overrides: list[str]) -> list[Problem]:
    """What ``with_searched_groups`` cannot carry: a sweep of modes that includes search
    (``mode=simulate,search``) keeps the group's option, which mode=search nulls again: say so
    rather than drop it."""
    out = []
    for o in overrides:
        key = _key(o)
        if key in SEARCHED_GROUPS and "=" in o:
            value, fixed = o.split("=", 1)[1], SEARCHED_GROUPS[key]
            out.append(Problem(key, value, f"in mode=search this is searched; fix it with {fixed}={value} "
                               f"(or search.candidates=['... {key}={value}'])"))
    return out


_GRAMMAR = "https://hydra.cc/docs/1.2/advanced/override_grammar/basic"


def syntax_problems(overrides: list[str]) -> dict[str, Problem]:
    """Each override Hydra's grammar refuses, and its problem: named by its key, with Hydra's
    reason on one line (Hydra names the whole command line, over two or three lines)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser, problems = OverridesParser.create(), {}
    for o in overrides:
        try:
            parser.parse_overrides([o])
        except OverrideParseException as exc:
            reason = "; ".join(
                line.strip() for line in str(exc).splitlines()
                if line.strip("^ ") and not line.startswith(("See ", "Error parsing override"))
            )
            key, sep, value = o.partition("=")
            problems[o] = Problem(key.lstrip("+~") or "<command line>", value if sep else o,
                                  f"{'a value' if sep else 'key=value'} in Hydra's override grammar ({reason}; {_GRAMMAR})")
    return problems


SWEEP_NEEDS_MULTIRUN = "a sweep of values needs -m / --multirun"


def _sweep_problems(overrides: list[str]) -> dict[str, Problem]:
    """Each sweep of values (``pcp=1,2``) where one job is composed (Hydra: "Ambiguous value",
    naming the whole command line)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    return {o: Problem(parsed.get_key_element(), o.split("=", 1)[-1], SWEEP_NEEDS_MULTIRUN)
            for o in overrides for parsed in parser.parse_overrides([o]) if parsed.is_sweep_override()}


def compose_checked(overrides: list[str], *, with_hydra: bool = False) -> tuple[dict[str, Any] | None, list[Problem]]:
    """The composed dict (None if nothing could be composed) and the overrides that could
    not be placed, as problems; those overrides are left out of the dict."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    problems, kept = _check_groups(with_measured_overrides(overrides))
    refused = syntax_problems(kept)
    refused.update(_sweep_problems([o for o in kept if o not in refused]))
    problems += refused.values()
    kept = [o for o in kept if o not in refused]
    for _ in range(len(kept) + 1):
        try:
            raw = None if with_hydra else _compose_on_cached_defaults(kept)
            if raw is None:
                with initialize_config_dir(config_dir=conf_dir(), version_base=None):
                    cfg = compose(config_name="config", overrides=kept, return_hydra_config=with_hydra)
                    raw = OmegaConf.to_container(cfg, resolve=True)
        except Exception as exc:  # Hydra/OmegaConf raise many types; all mean a bad override
            problem, key = _compose_problem(exc, kept)
            problems.append(problem)
            rest = [o for o in kept if key is None or _key(o) != key]
            if len(rest) == len(kept):
                return None, problems
            kept = rest
            continue
        assert isinstance(raw, dict)
        if not with_hydra:
            raw.pop("hydra", None)
        return raw, problems
    return None, problems


def _compose_on_cached_defaults(overrides: list[str]) -> dict[str, Any] | None:
    """What Hydra's ``compose`` gives for ``overrides`` (without its ``hydra`` node), ~15x faster
    where a command line chooses the same options as an earlier one; None where Hydra must
    compose it itself (then its own words name what is wrong).

    Hydra composes in two phases (``ConfigLoaderImpl._load_configuration_impl``): the options
    the overrides choose are merged into one struct config, then every other override is set on
    it (``_apply_overrides_to_config``). The first phase reads and merges ~15 YAML files (~70 ms)
    and depends only on the options chosen: it is kept per choice (and per conf/'s files), the
    second applied to a copy by Hydra's own function. An override Hydra could read otherwise
    (Hydra's own settings, a package, a dict for a group) and any error go to Hydra."""
    import copy

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    try:
        from hydra._internal.config_loader_impl import ConfigLoaderImpl

        apply = ConfigLoaderImpl._apply_overrides_to_config
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:  # NOTE: another Hydra than 1.3 (where the function lives): Hydra composes
        return None
    groups = set(config_groups())
    choices, values = [], []
    for o, line in zip(parsed, overrides):
        key = o.key_or_group
        if key.split(".")[0].split("/")[0] == "hydra" or o.package is not None or o.is_sweep_override():
            return None
        if key not in groups:
            values.append(o)
        elif isinstance(o.value(), dict):  # NOTE: Hydra sets a dict on a group's node as a value
            return None
        else:
            choices.append(line)
    try:
        cfg = copy.deepcopy(_defaults_config(tuple(choices), _conf_signature()))
        apply(values, cfg)
        raw = OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # NOTE: Hydra says what is wrong, composing the whole command line
        return None
    return raw if isinstance(raw, dict) else None


@functools.lru_cache(maxsize=64)
def _defaults_config(choices: tuple[str, ...], signature: tuple[Any, ...]) -> Any:
    """The struct config Hydra composes from the options ``choices`` choose, before any other
    override (``signature``: conf/'s files, so that an edited YAML is read again)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        return compose(config_name="config", overrides=list(choices))


def _conf_signature() -> tuple[Any, ...]:
    """conf/'s YAML files with their sizes and times (~0.3 ms to read)."""
    return tuple((str(p), (st := p.stat()).st_mtime_ns, st.st_size) for p in sorted(Path(conf_dir()).rglob("*.yaml")))


def with_measured_overrides(args: list[str]) -> list[str]:
    """With ``hardware=measured`` the profile's keys come from its file (``hardware.path``),
    after Hydra has composed: the command line's other ``hardware.*`` keys are added on top
    of it (``++``) instead of overriding keys ``conf/hardware/measured.yaml`` does not have."""
    if not uses_measured(args):
        return args
    return [f"++{a}" if a[:1] not in "+~-" and "=" in a and _key(a).startswith("hardware.") and _key(a) != "hardware.path"
            else a for a in args]


def uses_measured(args: list[str]) -> bool:
    """``hardware=measured`` is on the command line."""
    return any(_key(a) == "hardware" and a.partition("=")[2] == "measured" for a in args)


def is_hydra_override(o: str) -> bool:
    key = _key(o)
    return key == "hydra" or key.startswith(("hydra.", "hydra/"))


def _key(o: str) -> str:
    return o.lstrip("+~").split("=", 1)[0]


# ---------------------------------------------------------------------------- groups
def config_groups() -> dict[str, list[str]]:
    """Each config group of ``conf/`` and its options."""
    root = Path(conf_dir())
    return {
        d.name: sorted(p.stem for p in d.glob("*.yaml"))
        for d in sorted(root.iterdir())
        if d.is_dir() and not d.name.startswith(("_", "."))
    }


@functools.cache
def option_keys() -> dict[str, dict[str, frozenset[str]]]:
    """group -> option -> the dotted keys its YAML sets, as the composed config places them:
    under the group (``workload.prompt_lens``), or at the top for an option in the global
    package (``mode=simulate`` sets ``simulate.gemm_efficiency``)."""
    from omegaconf import OmegaConf

    out: dict[str, dict[str, frozenset[str]]] = {}
    for group, options in config_groups().items():
        out[group] = {}
        for option in options:
            path = Path(conf_dir()) / group / f"{option}.yaml"
            node = OmegaConf.to_container(OmegaConf.load(path))
            prefix = "" if "@package _global_" in path.read_text().split("\n", 1)[0] else f"{group}."
            out[group][option] = frozenset(prefix + k for k in _dotted(node if isinstance(node, dict) else {}))
    return out


def _dotted(node: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for k, v in node.items():
        keys.append(prefix + str(k))
        if isinstance(v, dict):
            keys += _dotted(v, f"{prefix}{k}.")
    return keys


def options_having(key: str) -> list[str]:
    """``group=option`` for each option that sets ``key`` (a key of its group's options, or
    of a global option such as ``mode=simulate``)."""
    owners = [f"{group}={o}" for group, options in option_keys().items() for o, keys in options.items()
              if key in keys and "." in key]
    # NOTE: a key under a group belongs to that group's options (mode=search only nulls
    # disagg.decode_pool.tp to search it)
    own = [o for o in owners if o.split("=", 1)[0] == key.split(".", 1)[0]]
    return own or owners


def hydra_problems(overrides: list[str]) -> list[Problem]:
    """Hydra's own settings and groups on the command line (``hydra/launcher=joblib``,
    ``hydra.job.chdir=...``) that Hydra would refuse once started (exit 1, its own words), or
    that pcpflow does not take, as problems."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import MissingConfigException

    problems: list[Problem] = []
    groups = [o for o in overrides if _key(o).startswith("hydra/")]
    for o in [*groups, *(o for o in overrides if o not in groups)]:  # NOTE: a setting with the groups that hold it
        key, _, value = o.lstrip("+~").partition("=")
        given = [o] if o in groups else [g for g in groups if not any(p.field == _key(g) for p in problems)] + [o]
        try:
            with initialize_config_dir(config_dir=conf_dir(), version_base=None):
                cfg = compose(config_name="config", overrides=given, return_hydra_config=True)
        except MissingConfigException as exc:
            problems.append(Problem(key, value, allowed_choices(value, exc.options or [])))
        except Exception as exc:  # Hydra raises many types; all mean this override
            reason = str(exc.__cause__ or exc).strip().splitlines()[0]
            if key.split(".")[:3] == ["hydra", "sweeper", "params"]:  # None in Hydra's config: no override reaches it
                reason = f"the sweep itself, after -m: -m pcp=1,2 dcp=1,2 (Hydra cannot set {key} from the command line)"
            problems.append(Problem(key, _given(key, [o]), reason))
        else:
            if key == "hydra.job.chdir" and cfg.hydra.job.chdir:
                problems.append(Problem(key, True, "false: pcpflow runs where it is started (the paths a command "
                                        "gives are read from there) and writes into the run dir either way"))
    return problems


def _check_groups(overrides: list[str]) -> tuple[list[Problem], list[str]]:
    groups, problems, kept = config_groups(), [], []
    for o in overrides:
        key, sep, value = o.lstrip("+~").partition("=")
        if sep and key in groups and value not in groups[key]:
            problems.append(Problem(key, value, allowed_choices(value, groups[key])))
        else:
            kept.append(o)
    return problems, kept


# ---------------------------------------------------------------------------- keys
@functools.cache
def known_keys() -> tuple[str, ...]:
    """Every dotted key of the default config and of every group option."""
    from pcpflow.config.run import RunConfig

    keys = {name for name, f in RunConfig.model_fields.items() if not _derived(f)}
    defaults, _ = compose_checked([])
    keys.update(_dotted({k: v for k, v in (defaults or {}).items() if k != "num_speculative_tokens"}))
    for group, options in option_keys().items():
        keys.add(group)
        for option_keys_ in options.values():
            keys.update(option_keys_)
    return tuple(sorted(keys))


def _derived(field: Any) -> bool:
    extra = field.json_schema_extra
    return isinstance(extra, dict) and bool(extra.get("derived"))


def unknown_key_problem(key: str, given: Any) -> Problem:
    from pcpflow.config.run import RunConfig, removed_note

    note = removed_note(key.lstrip("+~"))
    if note:
        return Problem(key, given, note)
    owners = options_having(key)
    if owners:
        return Problem(key, given, _belongs(key, owners))

    known = known_keys()
    close = closest(key, known, cutoff=0.75)
    if close and not key.startswith(close + "."):
        return Problem(key, given, f"not a pcpflow setting (did you mean {close!r}?)")
    parts = key.lstrip("+~").split(".")
    for n in range(len(parts) - 1, 0, -1):  # NOTE: the innermost known section it names: list what it holds
        section = ".".join(parts[:n])
        inside = sorted({k[len(section) + 1:].split(".")[0] for k in known if k.startswith(section + ".")})
        if inside:
            return Problem(key, given, f"not a setting of {section}; its settings: {', '.join(inside)}")
    top = ", ".join(n for n, f in RunConfig.model_fields.items() if not _derived(f))
    return Problem(
        key,
        given,
        f"not a pcpflow setting; top-level settings: {top}; config groups: "
        f"{', '.join(config_groups())}; stage settings live under pipeline.<slot>",
    )


def _belongs(key: str, owners: list[str]) -> str:
    return f"{key} is a setting of {' / '.join(owners)}; add {owners[0]} to the command line"


def _with_option_hint(p: Problem) -> Problem:
    """A ``+group.key`` that pydantic refused names the group option that has the key."""
    if not p.allowed.startswith(_NOT_HERE):
        return p
    owners = options_having(p.field)
    return Problem(p.field, p.given, _belongs(p.field, owners)) if owners else p


def _with_draft_tokens_hint(p: Problem, raw: dict[str, Any]) -> Problem:
    """A key for the drafts per step that could not be placed names the override that sets them
    for the run's draft stage: a plugin drafter takes them under ``pipeline.draft``, which the
    context-free hints ("did you mean draft.num_speculative_tokens", "add draft=dspark") miss."""
    from pcpflow.pipeline.assemble import DRAFT_TOKENS_KEYS, draft_tokens_override

    if p.field.lstrip("+~") not in DRAFT_TOKENS_KEYS:
        return p
    override = draft_tokens_override(raw, p.given)
    kind = ((raw.get("pipeline") or {}).get("draft") or {}).get("kind") or (raw.get("draft") or {}).get("kind")
    if override is None:
        owners = options_having("draft.num_speculative_tokens")
        # NOTE: draft=none proposes nothing: the drafters that take the key, as for draft.num_speculative_tokens
        return Problem(p.field, p.given, _belongs("draft.num_speculative_tokens", owners)) if kind == "none" and owners else p
    return Problem(p.field, p.given, f"the draft stage {kind!r} does not read it from here; set it with {override}")


def _without_drafting_in_profile(p: Problem, raw: dict[str, Any]) -> Problem:
    """A drafter's key that could not be placed, in mode=profile: the profile refuses drafting, not
    the key (the context-free hint, "add draft=dspark", would lead to that refusal)."""
    from pcpflow.pipeline.assemble import DRAFT_TOKENS_KEYS
    from pcpflow.profile.checks import NO_DRAFTING

    key = p.field.lstrip("+~")
    if raw.get("mode") != "profile" or not (key in DRAFT_TOKENS_KEYS or key.startswith(("draft.", "pipeline.draft."))):
        return p
    return Problem(p.field, p.given, NO_DRAFTING)


def _given(key: str, overrides: list[str]) -> Any:
    """The value the command line gives ``key``, as Hydra reads it (``tp=2``: 2, not '2')."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    o = next((o for o in overrides if _key(o) == key and "=" in o), None)
    if o is None:
        return None
    try:
        return OverridesParser.create().parse_override(o).value()
    except Exception:  # NOTE: a value Hydra cannot parse is shown as typed
        return o.split("=", 1)[1]


def _compose_problem(exc: Exception, overrides: list[str]) -> tuple[Problem, str | None]:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    m = re.search(r"Could not override '([^']+)'", text) or re.search(r"Key '([^']+)' is not in struct", text)
    if m:
        key = m.group(1)
        return unknown_key_problem(key, _given(key, overrides)), key
    m = re.search(r"An item is already at '([^']+)'", text)
    if m:
        key = m.group(1)
        return Problem("+" + key, _given(key, overrides), f"{key} is already set by the config: drop the '+'"), key
    m = re.search(r"full_key: (\S+)", text)  # NOTE: OmegaConf's (an interpolation that names no key)
    if m:
        key = m.group(1)
        return Problem(key, _given(key, overrides), first), key
    return Problem("<command line>", " ".join(overrides), first), None
