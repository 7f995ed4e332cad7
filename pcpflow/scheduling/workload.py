"""Requests from config: synthetic, explicit, or read from a Mooncake-format trace.

``build_requests`` turns the run's ``workload:`` config into a list of ``Request`` specs
(prompt token ids, output budget, arrival step); the scheduler owns everything that
changes while they run. Every rank builds the identical list from the same seed.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from pcpflow.errors import ConfigError, Problem

TRACE_BLOCK_TOKENS = 512
"""Prompt tokens behind one ``hash_ids`` entry of a Mooncake trace."""

# NOTE: stream tags keep the random streams of different uses independent for one seed.
_SYNTHETIC_STREAM = 1
_PROMPT_STREAM = 2
_TRACE_BLOCK_STREAM = 3
_TRACE_TAIL_STREAM = 4

Seed = Annotated[
    int | None,
    Field(ge=0, description="seed of this workload's random streams; null = the run's seed"),
]


class _WorkloadBase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SyntheticWorkload(_WorkloadBase):
    """Random prompts and output lengths, drawn uniformly from inclusive ranges."""

    kind: Literal["synthetic"] = "synthetic"
    num_requests: int = Field(8, ge=1, description="number of requests")
    prompt_len: tuple[Annotated[int, Field(ge=1)], Annotated[int, Field(ge=1)]] = Field(
        (5, 96), description="[min, max] prompt length in tokens (inclusive)"
    )
    output_len: tuple[Annotated[int, Field(ge=1)], Annotated[int, Field(ge=1)]] = Field(
        (4, 24), description="[min, max] generated tokens per request (inclusive)"
    )
    arrival_every: float = Field(
        1.0,
        ge=0,
        description="request i arrives at step floor(i * arrival_every); 0 = all at step 0",
    )
    seed: Seed = None
    ignore_eos: bool = Field(True, description="generate every output_len token, past any EOS")

    @field_validator("prompt_len", "output_len")
    @classmethod
    def _min_le_max(cls, value: tuple[int, int], info: ValidationInfo) -> tuple[int, int]:
        lo, hi = value
        if lo > hi:
            raise ValueError(
                f"{info.field_name} is [min, max] with 1 <= min <= max; got [{lo}, {hi}]"
            )
        return value


class ChatMessage(_WorkloadBase):
    """One turn of a conversation (``workload.chats``)."""

    role: str = Field(description="user, assistant, system, ... (as the chat template knows them)")
    content: str


class ExplicitWorkload(_WorkloadBase):
    """Requests spelled out: prompt lengths (random token ids) or the token ids themselves."""

    kind: Literal["explicit"] = "explicit"
    prompt_lens: list[Annotated[int, Field(ge=1)]] | None = Field(
        None, description="prompt length of each request (token ids drawn at random)"
    )
    # --- text in (pcpflow.tokens.text): texts / chats, tokenized by the driver into text_token_ids
    texts: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None,
        min_length=1,
        description="prompt texts, tokenized by the checkpoint's tokenizer (model=hf); "
        "replace prompt_lens",
    )
    chats: list[Annotated[list[ChatMessage], Field(min_length=1)]] | None = Field(
        None,
        min_length=1,
        description="conversations ([{role, content}, ..] each), rendered and tokenized by "
        "the checkpoint's chat template with the generation prompt; replace prompt_lens",
    )
    # --- end text in
    prompts: list[list[Annotated[int, Field(ge=0)]]] | None = Field(
        None,
        validate_default=True,
        description="token ids of each prompt; when given, prompt_lens is ignored; each in [0, vocab_size)",
    )
    output_lens: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=lambda: [4],
        min_length=1,
        description="tokens to generate per request: one per prompt, or one value for all",
    )
    arrival_steps: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, description="arrival step of each request (one per prompt); null = all at step 0"
    )
    cached_lens: list[Annotated[int, Field(ge=0)]] | None = Field(
        None,
        description="tokens of each prompt already in the KV cache (a prefix-cache hit): "
        "prefilled before the request's clock starts; each < its prompt length; null = none",
    )
    seed: Seed = None
    # --- text in
    ignore_eos: bool = Field(
        False, description="generate output_lens tokens even past the checkpoint's EOS"
    )
    text_token_ids: list[list[Annotated[int, Field(ge=0)]]] | None = Field(
        None,
        description="set by the driver, not by users: the token ids of texts / chats, so "
        "that every rank runs the ids the driver's tokenizer produced",
    )

    @model_validator(mode="after")
    def _text_sources(self):
        given = [k for k in ("texts", "chats", "prompts") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"give one of texts, chats or prompts; got {' and '.join(given)}")
        texts = self.texts if self.texts is not None else self.chats
        if self.text_token_ids is not None and (
            texts is None or len(texts) != len(self.text_token_ids)
        ):
            raise ValueError("text_token_ids is set by the driver from texts / chats; do not set it")
        return self
    # --- end text in

    @field_validator("prompts")
    @classmethod
    def _one_source(cls, prompts, info: ValidationInfo):
        # NOTE: prompts, when given, replace prompt_lens (the group's YAML carries example
        # lengths, and `workload.prompts=[[...]]` alone must be enough on the command line).
        if "prompt_lens" not in info.data:
            return prompts  # prompt_lens itself was invalid; pydantic reports that
        if prompts is None and info.data["prompt_lens"] is None and _num_prompts(info.data) is None:
            raise ValueError("give prompt_lens (lengths, random token ids) or prompts (token ids)")
        if prompts is not None and any(len(p) == 0 for p in prompts):
            empty = [i for i, p in enumerate(prompts) if len(p) == 0]
            raise ValueError(f"every prompt needs >= 1 token id; prompts {empty} are empty")
        return prompts

    @field_validator("output_lens")
    @classmethod
    def _output_lens_match(cls, output_lens, info: ValidationInfo):
        n = _num_prompts(info.data)
        if n is not None and len(output_lens) not in (1, n):
            raise ValueError(
                f"output_lens has {len(output_lens)} values for {n} prompts; allowed: "
                f"1 value (used for every prompt) or {n} values"
            )
        return output_lens

    @field_validator("arrival_steps")
    @classmethod
    def _arrival_steps_match(cls, arrival_steps, info: ValidationInfo):
        n = _num_prompts(info.data)
        if arrival_steps is not None and n is not None and len(arrival_steps) != n:
            raise ValueError(
                f"arrival_steps has {len(arrival_steps)} values for {n} prompts; allowed: "
                f"{n} values or null (all at step 0)"
            )
        return arrival_steps

    # --- cached prefixes (simulate issue)
    @field_validator("cached_lens")
    @classmethod
    def _cached_lens_fit(cls, cached_lens, info: ValidationInfo):
        if cached_lens is None:
            return None
        if info.data.get("prompts") is not None:
            lens = [len(p) for p in info.data["prompts"]]
        elif info.data.get("prompt_lens") is not None:
            lens = list(info.data["prompt_lens"])
        else:
            return cached_lens
        if len(cached_lens) not in (1, len(lens)):
            raise ValueError(
                f"cached_lens has {len(cached_lens)} values for {len(lens)} prompts; allowed: "
                f"1 value (used for every prompt) or {len(lens)} values"
            )
        full = cached_lens * len(lens) if len(cached_lens) == 1 else cached_lens
        bad = {i: (c, n) for i, (c, n) in enumerate(zip(full, lens)) if c >= n}
        if bad:
            raise ValueError(
                "each cached_lens value must be < its prompt length (at least one token is "
                "prefilled); got " + ", ".join(f"request {i}: {c} >= {n}" for i, (c, n) in bad.items())
            )
        return cached_lens

    @property
    def num_requests(self) -> int:
        for source in (self.texts, self.chats):
            if source is not None:
                return len(source)
        return len(self.prompts) if self.prompts is not None else len(self.prompt_lens or ())


def _num_prompts(data: dict[str, Any]) -> int | None:
    for key in ("texts", "chats"):
        if data.get(key) is not None:
            return len(data[key])
    if data.get("prompts") is not None:
        return len(data["prompts"])
    if data.get("prompt_lens") is not None and "prompts" in data:
        return len(data["prompt_lens"])
    return None


class TraceWorkload(_WorkloadBase):
    """Requests from a Mooncake-format JSONL trace (one JSON object a line:
    ``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``), lengths scaled.

    Prompt token ids are derived from ``hash_ids``: each 512-token block maps to token ids
    seeded by (seed, hash id), so requests that share hash ids share a prompt prefix.
    """

    kind: Literal["trace"] = "trace"
    path: str | None = Field(
        None,
        validate_default=True,
        description=(
            "the JSONL trace file (required); a relative path resolves against the current "
            "working directory when the config is validated"
        ),
    )
    max_requests: int = Field(16, ge=1, description="requests read from the trace")
    skip: int = Field(0, ge=0, description="requests (non-blank lines) skipped before reading")
    length_scale: float = Field(
        0.01,
        gt=0,
        le=1,
        description="input and output lengths are multiplied by this and rounded up to >= 1",
    )
    output_len_cap: int | None = Field(
        None, ge=1, description="upper bound on scaled output lengths; null = none"
    )
    step_ms: float = Field(
        50.0,
        gt=0,
        description="ms per scheduler step: arrival step = floor((ts - first ts) / step_ms)",
    )
    seed: Seed = None
    ignore_eos: bool = Field(True, description="generate every output length token, past any EOS")

    @field_validator("path")
    @classmethod
    def _path_required(cls, path: str | None) -> str:
        if path is None or not str(path).strip():
            raise ValueError(
                "the trace file is required: give workload.path=<file.jsonl> (a Mooncake-format "
                "JSONL trace; a clone bundles the head of one: scripts/data/mooncake_conversation_head.jsonl)"
            )
        # NOTE: resolved once, in the driver, so that ranks started elsewhere read the same file.
        return os.path.abspath(os.path.expanduser(str(path)))


WorkloadConfig = Annotated[
    SyntheticWorkload | ExplicitWorkload | TraceWorkload, Field(discriminator="kind")
]


@dataclass
class Request:
    """One request's input spec; its run state (computed tokens, outputs) is the scheduler's."""

    req_id: int
    prompt_token_ids: np.ndarray  # int64 [prompt_len]
    max_output_tokens: int
    arrival_step: int
    cached_len: int = 0  # prompt tokens already in the KV cache: prefilled before its clock

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def build_requests(config: WorkloadConfig, *, vocab_size: int, seed: int) -> list[Request]:
    """The workload's requests, ``req_id`` = index. Raises ``ConfigError`` for prompts
    outside the vocabulary and for a missing or malformed trace file."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    seed = seed if config.seed is None else config.seed
    if isinstance(config, SyntheticWorkload):
        return _synthetic(config, vocab_size, seed)
    if isinstance(config, ExplicitWorkload):
        return _explicit(config, vocab_size, seed)
    if isinstance(config, TraceWorkload):
        return _trace(config, vocab_size, seed)
    raise TypeError(f"unknown workload config {type(config).__name__}")


def _rng(seed: int, *keys: int) -> np.random.Generator:
    # NOTE: masking keeps negative run seeds valid (SeedSequence wants non-negative entropy).
    return np.random.default_rng([int(seed) & (2**64 - 1), *keys])


def _random_prompts(lens: np.ndarray, vocab_size: int, seed: int) -> list[np.ndarray]:
    rng = _rng(seed, _PROMPT_STREAM)
    tokens = rng.integers(0, vocab_size, size=int(lens.sum()), dtype=np.int64)
    return np.split(tokens, np.cumsum(lens)[:-1])


def _synthetic(cfg: SyntheticWorkload, vocab_size: int, seed: int) -> list[Request]:
    rng = _rng(seed, _SYNTHETIC_STREAM)
    n = cfg.num_requests
    prompt_lens = rng.integers(cfg.prompt_len[0], cfg.prompt_len[1] + 1, size=n)
    output_lens = rng.integers(cfg.output_len[0], cfg.output_len[1] + 1, size=n)
    arrivals = np.floor(np.arange(n) * cfg.arrival_every).astype(np.int64)
    prompts = _random_prompts(prompt_lens, vocab_size, seed)
    return [
        Request(i, prompts[i], int(output_lens[i]), int(arrivals[i])) for i in range(n)
    ]


def _explicit(cfg: ExplicitWorkload, vocab_size: int, seed: int) -> list[Request]:
    field, given_ids = "workload.prompts", cfg.prompts
    if cfg.texts is not None or cfg.chats is not None:  # text in
        field, given_ids = "workload." + ("texts" if cfg.texts is not None else "chats"), cfg.text_token_ids
        if given_ids is None:
            raise ConfigError([Problem(field, "<not tokenized>", "texts and chats are tokenized "
                                       "in the driver: pcpflow.tokens.text.tokenize_workload (prepare_job does it)")])
    if given_ids is not None:
        prompts = [np.asarray(p, dtype=np.int64) for p in given_ids]
        bad = [i for i, p in enumerate(prompts) if p.max() >= vocab_size]
        if bad:
            raise ConfigError([
                Problem(
                    field=field,
                    given={i: int(prompts[i].max()) for i in bad},
                    allowed=f"token ids in [0, {vocab_size}) (the model's vocab_size); "
                    f"prompts {bad} have larger ids",
                )
            ])
    else:
        prompts = _random_prompts(np.asarray(cfg.prompt_lens, dtype=np.int64), vocab_size, seed)
    n = len(prompts)
    outs = cfg.output_lens * n if len(cfg.output_lens) == 1 else cfg.output_lens
    arrivals = cfg.arrival_steps if cfg.arrival_steps is not None else [0] * n
    cached = cfg.cached_lens or [0]
    cached = cached * n if len(cached) == 1 else cached
    return [Request(i, prompts[i], int(outs[i]), int(arrivals[i]), int(cached[i])) for i in range(n)]


# -- traces ---------------------------------------------------------------------------------


def _trace_problem(cfg: TraceWorkload, what: str) -> ConfigError:
    return ConfigError([Problem(field="workload.path", given=cfg.path, allowed=what)])


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


_TRACE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def _parse_trace_line(line: str) -> tuple[float, int, int, list[int]]:
    """(timestamp, input_length, output_length, hash_ids); ValueError says what is wrong."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(rec, dict):
        raise ValueError(f"expected a JSON object, got {type(rec).__name__}")
    missing = [k for k in _TRACE_FIELDS if k not in rec]
    if missing:
        raise ValueError(f"missing field(s) {missing}")
    ts = rec["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not ts >= 0 or math.isinf(ts):
        raise ValueError(f"timestamp must be a number >= 0 (ms), got {ts!r}")
    for key in ("input_length", "output_length"):
        if not _is_count(rec[key]):
            raise ValueError(f"{key} must be an integer >= 0, got {rec[key]!r}")
    hash_ids = rec["hash_ids"]
    if not isinstance(hash_ids, list) or not all(_is_count(h) for h in hash_ids):
        raise ValueError(f"hash_ids must be a list of integers >= 0, got {hash_ids!r}")
    return float(ts), rec["input_length"], rec["output_length"], hash_ids


def _read_trace(cfg: TraceWorkload) -> list[tuple[float, int, int, list[int]]]:
    records: list[tuple[float, int, int, list[int]]] = []
    seen = 0
    try:
        with open(cfg.path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                seen += 1
                if seen <= cfg.skip:
                    continue
                try:
                    records.append(_parse_trace_line(line))
                except ValueError as e:
                    raise _trace_problem(
                        cfg, f"a well-formed trace; {cfg.path}:{lineno}: {e}"
                    ) from None
                if len(records) == cfg.max_requests:
                    break
    except FileNotFoundError:
        raise _trace_problem(
            cfg, f"an existing JSONL trace file; {cfg.path} does not exist"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise _trace_problem(
            cfg, f"a readable JSONL trace file; reading {cfg.path} failed: {e}"
        ) from None
    if not records:
        raise _trace_problem(
            cfg, f"a trace with requests after skip={cfg.skip}; {cfg.path} has {seen} request(s)"
        )
    return records


def _scale(length: int, scale: float) -> int:
    return max(1, math.ceil(length * scale))


def _trace(cfg: TraceWorkload, vocab_size: int, seed: int) -> list[Request]:
    records = _read_trace(cfg)
    s = cfg.length_scale
    block_tokens = _scale(TRACE_BLOCK_TOKENS, s)
    block_cache: dict[int, np.ndarray] = {}
    t0 = min(r[0] for r in records)
    requests = []
    for i, (ts, input_length, output_length, hash_ids) in enumerate(records):
        prompt_len = _scale(input_length, s)
        # NOTE: block k covers scaled positions [floor(512 k s), floor(512 (k+1) s)): the
        # boundaries depend on k only, so equal hash-id prefixes give equal token prefixes.
        bounds = np.minimum(
            np.floor(np.arange(len(hash_ids) + 1) * TRACE_BLOCK_TOKENS * s).astype(np.int64),
            prompt_len,
        )
        parts = []
        for k, h in enumerate(hash_ids):
            if h not in block_cache:
                block_cache[h] = _rng(seed, _TRACE_BLOCK_STREAM, h).integers(
                    0, vocab_size, size=block_tokens, dtype=np.int64
                )
            parts.append(block_cache[h][: bounds[k + 1] - bounds[k]])
        tail = prompt_len - int(bounds[-1])  # prompt beyond its hash blocks: request's own
        if tail > 0:
            rng = _rng(seed, _TRACE_TAIL_STREAM, cfg.skip + i)
            parts.append(rng.integers(0, vocab_size, size=tail, dtype=np.int64))
        max_out = _scale(output_length, s)
        if cfg.output_len_cap is not None:
            max_out = min(max_out, cfg.output_len_cap)
        arrival = int(math.floor((ts - t0) / cfg.step_ms))
        requests.append(Request(i, np.concatenate(parts), max_out, arrival))
    return requests


# --- request lengths (the driver's checks, pcpflow.driver.checks) ----------------------------------
def request_lengths(config: WorkloadConfig, *, seed: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(prompt lengths, output budgets) of ``build_requests``'s requests, without building
    a token array: the driver checks that a workload fits before anything allocates it.
    Raises the same ConfigErrors (trace file, prompt ids outside the vocabulary)."""
    seed = seed if config.seed is None else config.seed
    if isinstance(config, SyntheticWorkload):
        rng = _rng(seed, _SYNTHETIC_STREAM)
        prompt = rng.integers(config.prompt_len[0], config.prompt_len[1] + 1, size=config.num_requests)
        output = rng.integers(config.output_len[0], config.output_len[1] + 1, size=config.num_requests)
        return prompt.astype(np.int64), output.astype(np.int64)
    if isinstance(config, ExplicitWorkload):
        if config.prompts is not None:
            _explicit(config, vocab_size, seed)  # the user's own ids: small, and checked there
            prompt = np.array([len(p) for p in config.prompts], dtype=np.int64)
        else:
            prompt = np.asarray(config.prompt_lens, dtype=np.int64)
        outs = config.output_lens * len(prompt) if len(config.output_lens) == 1 else config.output_lens
        return prompt, np.asarray(outs, dtype=np.int64)
    if isinstance(config, TraceWorkload):
        records = _read_trace(config)
        s = config.length_scale
        prompt = np.array([_scale(r[1], s) for r in records], dtype=np.int64)
        output = np.array([_scale(r[2], s) for r in records], dtype=np.int64)
        if config.output_len_cap is not None:
            output = np.minimum(output, config.output_len_cap)
        return prompt, output
    raise TypeError(f"unknown workload config {type(config).__name__}")
