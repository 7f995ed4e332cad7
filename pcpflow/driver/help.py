"""``python -m pcpflow --help``: pcpflow's own page, its groups and settings read from
``conf/`` and the pydantic models (so that it cannot drift from what a run accepts)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel

from pcpflow.paths import conf_dir

_HEAD = """\
pcpflow: run, verify, measure and sweep prefill/decode context parallelism (PCP/DCP) for
LLM inference. N rank processes split each step's tokens (and KV cache) as vLLM does; the
run is checked against the same pipeline on one rank (logits, tokens, every KV entry).

usage:
  python -m pcpflow [key=value ...]                  one run (ranks started for you)
  python -m pcpflow -m key=a,b [key=c,d ...]         a sweep: every combination, one table
  torchrun --nproc-per-node N -m pcpflow pcp=N       ranks started by torchrun / srun

commands people run:
  python -m pcpflow                                  pcp=2 on CPU, tiny MLA model, verified
  python -m pcpflow pcp=4 dcp=4 decode=sharded       4 ranks, KV sharded 4 ways
  python -m pcpflow -m pcp=1,2,4 decode=sharded,replicated
  python -m pcpflow draft=mtp                        speculative decoding with an MTP head
  python -m pcpflow workload=trace workload.path=scripts/data/mooncake_conversation_head.jsonl
  python -m pcpflow mode=simulate model=llama3_70b hardware=h200_sxm tp=8 pcp=2 workload=trace
      workload.path=scripts/data/mooncake_conversation_head.jsonl slo.ttft_s=2 slo.tpot_s=0.1
                                                 serving the trace as it is (every request, its
                                                 lengths): arrivals in time, prefix cache, goodput
  python -m pcpflow mode=profile pcp=2               measure this machine -> DIR/hardware.yaml
  python -m pcpflow mode=simulate hardware=measured hardware.path=DIR/hardware.yaml dtype=float32 ...
  python -m pcpflow mode=search model=llama3_405b hardware=gtt_h100 search.gpus=32
      workload=explicit 'workload.prompt_lens=[131072]' simulate.objective=ttft
                                                 the best layouts of 32 GPUs (docs/search.md)
  python -m pcpflow --cfg job pcp=4                  the composed config (validated first)
"""

_TAIL = """\
exit codes:
  0 ok   1 failed (a rank failed, or verification found a mismatch)
  2 invalid configuration (every problem listed, no rank started)
  130/143/129/131 interrupted (SIGINT/SIGTERM/SIGHUP/SIGQUIT; result.json says so)

results (a run):   outputs/<date>/<time>/ or hydra.run.dir=DIR: result.json (status, verify,
                   metrics, outputs), metrics.jsonl (one line per step), config.json (the
                   frozen config), load.png, serving.png, logs/ (one log per rank);
                   requests.csv for a simulated run of more than 20,000 requests
results (a sweep): multirun/<date>/<time>/ or hydra.sweep.dir=DIR: sweep.csv, sweep.md,
                   sweep.png, and one run directory per job
results (a search): search.csv (a row per priced layout), pruned.csv, search.md, search.png

more: README.md; every setting with its default: docs/configuration.md; Hydra's own
flags: --hydra-help; tab completion of the pcpflow script's settings and options:
eval "$(pcpflow --shell-completion install=bash)" (or zsh, fish)
"""


def help_text() -> str:
    return "\n".join([_HEAD, _groups(), _settings(), _TAIL])


def _groups() -> str:
    from omegaconf import OmegaConf

    from pcpflow.driver.compose import config_groups

    defaults: dict[str, str] = {}
    for item in OmegaConf.to_container(OmegaConf.load(Path(conf_dir()) / "config.yaml")).get("defaults", []):
        if isinstance(item, dict):
            defaults.update({str(k): str(v) for k, v in item.items()})
    lines = ["config groups (group=option; * = default):"]
    for group, options in config_groups().items():
        shown = [f"{o}*" if defaults.get(group) == o else o for o in options]
        lines.append(f"  {group:<10} {', '.join(shown)}")
    lines.append("  an option's own settings: group.key=value (e.g. workload.num_requests=4)")
    return "\n".join(lines) + "\n"


def _settings() -> str:
    from pcpflow.config.run import RunConfig

    lines = ["settings (key=value; default in brackets):"]
    for name, field in RunConfig.model_fields.items():
        extra = field.json_schema_extra
        if isinstance(extra, dict) and extra.get("derived"):
            continue
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            lines += _section(name, sub)
        elif name in ("model", "workload", "draft", "pipeline"):
            lines.append(f"  {name + '.<key>':<34} the settings of the {name} option in use (config groups above)")
        else:
            lines.append(_line(name, field.default if field.default_factory is None else field.default_factory(), field.description))
    return "\n".join(lines) + "\n"


def _section(prefix: str, model: type[BaseModel]) -> list[str]:
    """A line per setting of a section, a nested section's settings under its own prefix."""
    lines = []
    for key, f in model.model_fields.items():
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            lines += _section(f"{prefix}.{key}", f.annotation)
        else:
            lines.append(_line(f"{prefix}.{key}", f.get_default(call_default_factory=True), f.description))
    return lines


def _line(key: str, default: Any, description: str | None) -> str:
    text = f"{_first(description)} [{_show(default)}]".strip()
    return f"  {key:<34} {text}"


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _first(description: str | None) -> str:
    text = " ".join((description or "").split())
    return text if len(text) <= 70 else text[:67].rsplit(" ", 1)[0] + " ..."
