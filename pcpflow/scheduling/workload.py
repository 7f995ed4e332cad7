"""Requests from config: synthetic, explicit, or read from a Mooncake-format trace.

``request_table`` turns the run's ``workload:`` config into a ``RequestTable``: columns of
lengths and arrivals, and either the prompts' token ids (executed runs, which compute on
them) or only what keys their KV blocks for prefix caching (simulated runs: a trace's
``hash_ids``, a random prompt's identity), so that a simulated run holds a few numbers per
request and never a token array. ``build_requests`` lists the same requests as
``Request`` objects with token ids (what an executed rank's stages read). The scheduler
owns everything that changes while they run. Every rank builds the identical requests
from the same seed.

Arrivals: in scheduler steps (``arrival_every``, ``arrival_steps``, a trace's timestamps
over ``step_ms``), or, in simulated runs, in time (``request_rate``: Poisson; a trace's
timestamps x ``time_scale``). ``max_concurrency`` caps the requests in flight on every
workload (``pcpflow.scheduling.arrivals``).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import Field, ValidationInfo, field_validator, model_validator

from pcpflow.errors import ConfigError, Problem, Settings
from pcpflow.scheduling import prefix
from pcpflow.scheduling.trace import TraceColumns, read_trace, trace_problem

TRACE_BLOCK_TOKENS = 512
"""Prompt tokens behind one ``hash_ids`` entry of a Mooncake trace."""
MAX_TOKENS = 2**53
"""Largest length a workload may give (exact in float64, far from int64's end)."""
DEFAULT_STEP_MS = 50.0
"""A trace's ms per scheduler step when it arrives in steps and ``step_ms`` is null."""
MAX_ARRIVAL_S = 1e9
"""Latest arrival in time a workload may ask for (s, ~32 years): up to it float64 holds the run
clock to 2^-23 s (0.12 us), beyond it coarser, until a step's duration is lost."""
_WHY_MAX_ARRIVAL = (f"beyond {MAX_ARRIVAL_S:g} s, float64 no longer holds the run clock to 0.12 us and a step's "
                    "duration gets lost in it")

# NOTE: stream tags keep the random streams of different uses independent for one seed.
_SYNTHETIC_STREAM = 1
_PROMPT_STREAM = 2
_TRACE_BLOCK_STREAM = 3
_TRACE_TAIL_STREAM = 4
_ARRIVAL_STREAM = 5

INT64_MAX = 2**63 - 1

Seed = Annotated[
    int | None,
    Field(ge=0, description="seed of this workload's random streams; null = the run's seed"),
]


RequestRate = Annotated[
    float | None,
    Field(gt=0, allow_inf_nan=True, description="simulated runs: requests per second, Poisson arrivals in time "
          "(inf: all at once), at least (requests - 1) / 1e9 (the last arrival within 1e9 s, where float64 "
          "resolves a step); null: arrivals in steps"),
]
MaxConcurrency = Annotated[
    int | None,
    Field(ge=1, description="most requests in flight (arrived, not finished): a later one "
          "waits for a finish, as `vllm bench serve --max-concurrency` (a closed loop with "
          "request_rate=inf); null: no cap"),
]


class _RateChecks(Settings):
    """``request_rate`` is arrivals in time: not beside arrivals in steps."""

    @field_validator("request_rate", mode="before", check_fields=False)
    @classmethod
    def _rate_is_a_number(cls, rate):
        # NOTE: nan passes allow_inf_nan (which is for inf) and then fails gt=0 with a message
        # that hides what is wrong with it
        if isinstance(rate, float | str) and str(rate).strip().lower() == "nan":
            raise ValueError("a rate > 0 in requests/s, or inf (all at once); nan is not a rate")
        return rate

    @field_validator("request_rate", check_fields=False)
    @classmethod
    def _rate_alone(cls, rate, info: ValidationInfo):
        steps = "arrival_every" if "arrival_every" in cls.model_fields else "arrival_steps"
        if rate is not None and info.data.get(steps) is not None:
            raise ValueError(f"request_rate (arrivals in time) and {steps} (arrivals in steps) exclude "
                             f"each other: leave {steps} out (null) to give a rate")
        return rate

    @field_validator("request_rate", check_fields=False)
    @classmethod
    def _rate_on_the_clock(cls, rate, info: ValidationInfo):
        n = info.data.get("num_requests") if "num_requests" in cls.model_fields else _num_prompts(info.data)
        if rate is not None and n is not None and (n - 1) / rate > MAX_ARRIVAL_S:
            raise ValueError(f"{n} requests at {rate:g}/s arrive until ~{(n - 1) / rate:.3g} s ((requests - 1) / "
                             f"rate, the first at 0): {_WHY_MAX_ARRIVAL}; allowed: >= {(n - 1) / MAX_ARRIVAL_S:.3g} "
                             "requests/s for these requests, or inf (all at once)")
        return rate


class SyntheticWorkload(_RateChecks):
    """Random prompts and output lengths, drawn uniformly from inclusive ranges."""

    kind: Literal["synthetic"] = "synthetic"
    num_requests: int = Field(8, ge=1, le=MAX_TOKENS, description="number of requests")
    prompt_len: tuple[Annotated[int, Field(ge=1, le=MAX_TOKENS)], Annotated[int, Field(ge=1, le=MAX_TOKENS)]] = Field(
        (5, 96), description="[min, max] prompt length in tokens (inclusive)"
    )
    output_len: tuple[Annotated[int, Field(ge=1, le=MAX_TOKENS)], Annotated[int, Field(ge=1, le=MAX_TOKENS)]] = Field(
        (4, 24), description="[min, max] generated tokens per request (inclusive)"
    )
    arrival_every: float | None = Field(
        None,
        ge=0,
        description="request i arrives at step floor(i * arrival_every); 0 = all at step 0; "
        "null: 1, or arrivals in time with request_rate",
    )
    request_rate: RequestRate = None
    max_concurrency: MaxConcurrency = None
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


class ChatMessage(Settings):
    """One turn of a conversation (``workload.chats``)."""

    role: str = Field(description="user, assistant, system, ... (as the chat template knows them)")
    content: str


class ExplicitWorkload(_RateChecks):
    """Requests spelled out: prompt lengths (random token ids) or the token ids themselves."""

    kind: Literal["explicit"] = "explicit"
    prompt_lens: list[Annotated[int, Field(ge=1, le=MAX_TOKENS)]] | None = Field(
        None, min_length=1, description="prompt length of each request (token ids drawn at random)"
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
    prompts: list[list[Annotated[int, Field(ge=0, le=2**63 - 1)]]] | None = Field(
        None,
        min_length=1,
        validate_default=True,
        description="token ids of each prompt; when given, prompt_lens is ignored; each in [0, vocab_size)",
    )
    output_lens: list[Annotated[int, Field(ge=1, le=MAX_TOKENS)]] = Field(
        default_factory=lambda: [4],
        min_length=1,
        description="tokens to generate per request: one per prompt, or one value for all",
    )
    arrival_steps: list[Annotated[int, Field(ge=0, le=MAX_TOKENS)]] | None = Field(
        None, description="arrival step of each request (one per prompt); null = all at step 0"
    )
    request_rate: RequestRate = None
    max_concurrency: MaxConcurrency = None
    cached_lens: list[Annotated[int, Field(ge=0, le=MAX_TOKENS)]] | None = Field(
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
        texts = info.data.get("texts") if info.data.get("texts") is not None else info.data.get("chats")
        if texts is not None:  # NOTE: their lengths are known once tokenized (pcpflow.tokens.text)
            lens = None
            if len(cached_lens) not in (1, len(texts)):
                raise ValueError(cached_lens_problem(cached_lens, [0] * len(texts)))
        elif info.data.get("prompts") is not None:
            lens = [len(p) for p in info.data["prompts"]]
        elif info.data.get("prompt_lens") is not None:
            lens = list(info.data["prompt_lens"])
        else:
            lens = None
        problem = cached_lens_problem(cached_lens, lens) if lens is not None else None
        if problem:
            raise ValueError(problem)
        return cached_lens

    def text_problems(self) -> list[Problem]:
        """``cached_lens`` against the tokenized texts / chats (``text_token_ids``, set once
        the driver tokenized them: ``prompt_lens`` does not apply to texts)."""
        if self.cached_lens is None or self.text_token_ids is None:
            return []
        problem = cached_lens_problem(self.cached_lens, [len(p) for p in self.text_token_ids])
        return [Problem("workload.cached_lens", self.cached_lens, problem)] if problem else []

    @property
    def num_requests(self) -> int:
        for source in (self.texts, self.chats):
            if source is not None:
                return len(source)
        return len(self.prompts) if self.prompts is not None else len(self.prompt_lens or ())


def cached_lens_problem(cached_lens: list[int], prompt_lens: list[int]) -> str | None:
    """What is wrong with ``workload.cached_lens`` for prompts of these lengths (None: fine)."""
    n = len(prompt_lens)
    if len(cached_lens) not in (1, n):
        return (f"cached_lens has {len(cached_lens)} values for {n} prompts; allowed: "
                f"1 value (used for every prompt) or {n} values")
    full = cached_lens * n if len(cached_lens) == 1 else cached_lens
    bad = {i: (c, p) for i, (c, p) in enumerate(zip(full, prompt_lens)) if c >= p}
    if bad:
        return ("each cached_lens value must be < its prompt length (at least one token is "
                "prefilled); got " + ", ".join(f"request {i}: {c} >= {p}" for i, (c, p) in bad.items()))
    return None


def _num_prompts(data: dict[str, Any]) -> int | None:
    for key in ("texts", "chats"):
        if data.get(key) is not None:
            return len(data[key])
    if data.get("prompts") is not None:
        return len(data["prompts"])
    if data.get("prompt_lens") is not None and "prompts" in data:
        return len(data["prompt_lens"])
    return None


class TraceWorkload(Settings):
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
    max_requests: int | None = Field(
        None, ge=1, le=MAX_TOKENS,
        description="requests read from the trace; null: 16 in executed runs, every request in simulated ones",
    )
    skip: int = Field(0, ge=0, description="requests (non-blank lines) skipped before reading")
    length_scale: float | None = Field(
        None,
        gt=0,
        le=1,
        description="input and output lengths are multiplied by this and rounded up to >= 1; null: "
        "0.01 in executed runs (tiny models on CPU ranks), 1 (the trace's own lengths) in simulated ones",
    )
    output_len_cap: int | None = Field(
        None, ge=1, description="upper bound on scaled output lengths; null = none"
    )
    step_ms: float | None = Field(
        None,
        gt=0,
        description="ms per scheduler step: arrival step = floor((ts - first ts) * time_scale / "
        "step_ms); null: 50 in executed runs, and simulated runs replay the timestamps in time",
    )
    time_scale: float = Field(
        1.0, gt=0, description="timestamps are multiplied by this (2 = half the request rate); in time, the "
        "last arrival within 1e9 s (where float64 resolves a step)"
    )
    max_concurrency: MaxConcurrency = None
    seed: Seed = None
    ignore_eos: bool = Field(True, description="generate every output length token, past any EOS")

    @property
    def ms_per_step(self) -> float:
        return DEFAULT_STEP_MS if self.step_ms is None else self.step_ms

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


@dataclass
class BlockIdentity:
    """What keys a request's full prompt blocks when no token ids are held (simulated runs):
    a random prompt is its own (``salts``, one per request); a trace prompt's positions
    inside its hash blocks hold the tokens of those blocks (``hash_ids``, flat, request i's
    at ``hash_starts[i]:hash_starts[i+1]``, ``trace_block_tokens`` scaled tokens each), the
    rest is its own. Equal keys exactly where an executed run's token ids are equal."""

    salts: np.ndarray  # uint64 [N]
    hash_ids: np.ndarray | None = None  # uint64, flat
    hash_starts: np.ndarray | None = None  # int64 [N+1]
    trace_block_tokens: float = float(TRACE_BLOCK_TOKENS)


NEVER_PRIVATE = np.iinfo(np.int64).max
"""``RequestTable.private_from`` where every block a request computes may be another's too."""


@dataclass
class RequestTable:
    """The workload's requests as columns (request i has ``req_id`` i): what a scheduler
    needs, a few numbers per request. ``tokens`` (every prompt's ids, flat, in order) where
    the run computes on them or the user gave them; else ``identity`` keys the blocks."""

    prompt_lens: np.ndarray  # int64 [N]
    output_lens: np.ndarray  # int64 [N]: max output tokens
    arrival_steps: np.ndarray  # int64 [N]: arrival step (when not timed)
    cached_lens: np.ndarray  # int64 [N]: explicit cached prefix (``workload.cached_lens``)
    arrival_s: np.ndarray | None = None  # float64 [N]: arrival time in seconds (timed); None: in steps
    max_concurrency: int | None = None
    tokens: np.ndarray | None = None  # int64 flat prompt ids
    identity: BlockIdentity | None = None

    def __len__(self) -> int:
        return len(self.prompt_lens)

    @property
    def timed(self) -> bool:
        return self.arrival_s is not None

    @functools.cached_property
    def token_starts(self) -> np.ndarray:
        starts = np.zeros(len(self) + 1, dtype=np.int64)
        np.cumsum(self.prompt_lens, out=starts[1:])
        return starts

    def prompt(self, i: int) -> np.ndarray:
        if self.tokens is None:
            raise ValueError("this workload holds lengths only (a simulated run builds no token ids)")
        return self.tokens[self.token_starts[i]:self.token_starts[i + 1]]

    def requests(self) -> list[Request]:
        """The same requests as ``Request`` objects (token ids included)."""
        return [Request(i, self.prompt(i), int(self.output_lens[i]), int(self.arrival_steps[i]), int(self.cached_lens[i]))
                for i in range(len(self))]

    @classmethod
    def from_requests(cls, requests: list[Request]) -> RequestTable:
        """Columns of ``requests`` (listed by ``req_id`` = index, as ``build_requests`` makes them)."""
        if [r.req_id for r in requests] != list(range(len(requests))):
            raise ValueError("requests must be listed by req_id = 0, 1, ... (as build_requests makes them)")
        n = len(requests)

        def column(values) -> np.ndarray:
            return np.fromiter(values, dtype=np.int64, count=n)

        tokens = [np.asarray(r.prompt_token_ids, dtype=np.int64) for r in requests]
        return cls(
            prompt_lens=column(len(t) for t in tokens),
            output_lens=column(r.max_output_tokens for r in requests),
            arrival_steps=column(r.arrival_step for r in requests),
            cached_lens=column(getattr(r, "cached_len", 0) for r in requests),
            tokens=np.concatenate(tokens) if tokens else np.zeros(0, np.int64),
        )

    def prompt_contents(self, i: int, tokens_per_block: int) -> tuple[np.ndarray, int]:
        """(contents ``c_j`` of request i's full prompt blocks, a key of its whole prompt)
        for its chained block hashes (``pcpflow.scheduling.prefix``): from its token ids,
        else from its ``identity`` (``identity_contents``)."""
        if self.tokens is None:
            contents, _, keys = self.identity_contents(np.array([i]), tokens_per_block)
            return contents, int(keys[0])
        n = int(self.prompt_lens[i])
        ids = self.prompt(i)
        contents = prefix.token_contents(ids[:n // tokens_per_block * tokens_per_block], tokens_per_block)
        return contents, int(prefix.mix(n, *(ids.astype(np.uint64) + np.uint64(1)))[0])

    def identity_contents(self, reqs: np.ndarray, tokens_per_block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``prompt_contents`` of requests ``reqs`` at once, from the ``identity`` of a table
        without token ids: (their contents back to back, request ``reqs[r]``'s at
        ``starts[r]:starts[r + 1]``; ``starts``; their prompt keys, uint64)."""
        ident = self.identity
        assert ident is not None, "a table without token ids has a BlockIdentity"
        U = tokens_per_block
        n = self.prompt_lens[reqs]
        full = n // U
        starts = np.zeros(len(reqs) + 1, dtype=np.int64)
        np.cumsum(full, out=starts[1:])
        row = np.repeat(np.arange(len(reqs)), full)
        j = np.arange(starts[-1]) - starts[row]
        own = prefix.splitmix64(ident.salts[reqs])  # mix(salt): the head of a block that is the request's own
        head, key_head = own[row], own.copy()
        if ident.hash_ids is not None:
            # A block whose positions all lie in hash blocks holds the tokens of those hash
            # blocks, which the chain of hash ids up to its last position identifies.
            heads, first, bounds, hashed_end = self._trace_heads(reqs)
            last_pos = (j + 1) * U - 1
            inside = np.flatnonzero(last_pos < hashed_end[row])
            tokens = ident.trace_block_tokens
            if float(tokens).is_integer():  # NOTE: bounds are multiples of it: the hash block is a division
                k = last_pos[inside] // int(tokens)
            else:
                k = np.searchsorted(bounds, last_pos[inside], side="right") - 1
            head[inside] = heads[first[row[inside]] + k]
            whole = np.flatnonzero(n <= hashed_end)  # the prompt ends inside its hash blocks
            k = np.searchsorted(bounds, n[whole] - 1, side="right") - 1
            key_head[whole] = heads[first[whole] + k]
        # NOTE: mix(head, x) = mix_with(mix(head), x): each head mixed once
        return prefix.mix_with(head, j), starts, prefix.mix_with(key_head, n)

    def _trace_heads(self, reqs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The heads of requests ``reqs``' hash blocks (the chain of their hash ids, mixed),
        back to back, request ``reqs[r]``'s from ``first[r]``; the hash blocks' bounds in
        tokens (block k covers ``[bounds[k], bounds[k + 1])`` in every request); and where
        each request's hashed positions end (``min(its hash blocks' end, its prompt)``)."""
        ident = self.identity
        lens = ident.hash_starts[reqs + 1] - ident.hash_starts[reqs]
        first = np.cumsum(lens) - lens
        at = np.repeat(ident.hash_starts[reqs] - first, lens) + np.arange(lens.sum())
        heads = prefix.splitmix64(prefix.chain(prefix.splitmix64(ident.hash_ids[at]), lengths=lens))
        bounds = np.floor(np.arange(lens.max(initial=0) + 1) * ident.trace_block_tokens).astype(np.int64)
        return heads, first, bounds, np.minimum(bounds[lens], self.prompt_lens[reqs])

    def private_from(self, tokens_per_block: int) -> np.ndarray:
        """For each request, the first block-table entry from which its chain of blocks is its
        own: no other request of the table can compute a block with the same key there or
        later (it would need the same content in every block up to it). int64 [N];
        ``NEVER_PRIVATE`` where that cannot be told: token ids (any prompt may repeat
        another's) or a prompt whose every block another request may share.

        Block j's content is ``mix(head_j, j)`` (``identity_contents``): a head no other
        request carries makes block j, and by the chain every block after it, the
        request's own; a block past the prompt's full blocks holds outputs, keyed by the
        whole prompt. The bound is conservative: a head counts as shared if another
        request carries it anywhere."""
        N = len(self)
        ident = self.identity
        if self.tokens is not None or ident is None or not N:
            return np.full(N, NEVER_PRIVATE, dtype=np.int64)
        U = tokens_per_block
        n = self.prompt_lens
        full = n // U
        own = prefix.splitmix64(ident.salts)
        key_head = own.copy()
        heads, hashed_end = np.zeros(0, np.uint64), np.zeros(N, np.int64)
        if ident.hash_ids is not None:
            heads, first, bounds, hashed_end = self._trace_heads(np.arange(N))
            whole = np.flatnonzero(n <= hashed_end)
            key_head[whole] = heads[first[whole] + np.searchsorted(bounds, n[whole] - 1, side="right") - 1]
        shared = _carried_twice(np.concatenate([heads, own]))
        inside = hashed_end // U  # blocks 0..inside-1 lie in hash blocks; the rest of the prompt is its own
        out = np.where(~shared[len(heads):] & (inside < full), inside, NEVER_PRIVATE)
        if len(heads):
            # the first hash block whose head no other request carries, and the first block in it
            row = np.repeat(np.arange(N), np.diff(np.append(first, len(heads))))
            lone = np.flatnonzero(~shared[:len(heads)])
            owners, at = np.unique(row[lone], return_index=True)
            j = bounds[lone[at] - first[owners]] // U
            ok = j < inside[owners]
            out[owners[ok]] = np.minimum(out[owners[ok]], j[ok])
        # every prompt block may be shared: the outputs are the request's own unless its whole prompt is another's
        rest = out >= full
        key_lone = ~_carried_twice(prefix.mix_with(key_head, n))
        out[rest] = np.where(key_lone[rest], full[rest], NEVER_PRIVATE)
        return out


def _carried_twice(values: np.ndarray) -> np.ndarray:
    """Whether each of ``values`` occurs more than once among them."""
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    return counts[inverse] > 1


def build_requests(config: WorkloadConfig, *, vocab_size: int, seed: int) -> list[Request]:
    """The workload's requests with their token ids, ``req_id`` = index. Raises
    ``ConfigError`` for prompts outside the vocabulary and for a missing or malformed trace."""
    return request_table(config, vocab_size=vocab_size, seed=seed, with_tokens=True).requests()


def request_table(config: WorkloadConfig, *, vocab_size: int, seed: int, with_tokens: bool,
                  simulated: bool = False) -> RequestTable:
    """The workload's requests as columns. ``with_tokens``: draw every prompt's token ids
    (an executed run); else lengths and block identities only (a user's own ids are kept).
    ``simulated``: arrivals in time where the workload says so (``request_rate``, a trace
    without ``step_ms``). Raises ``ConfigError`` as ``build_requests`` does."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    seed = seed if config.seed is None else config.seed
    if isinstance(config, SyntheticWorkload):
        table = _synthetic(config, vocab_size, seed, with_tokens)
    elif isinstance(config, ExplicitWorkload):
        table = _explicit(config, vocab_size, seed, with_tokens)
    elif isinstance(config, TraceWorkload):
        table = _trace(config, vocab_size, seed, with_tokens, simulated)
    else:
        raise TypeError(f"unknown workload config {type(config).__name__}")
    rate = getattr(config, "request_rate", None)
    if rate is not None and simulated:
        table.arrival_s = poisson_arrivals(len(table), rate, seed)
        table.arrival_steps = np.zeros(len(table), dtype=np.int64)
    table.max_concurrency = config.max_concurrency
    return table


def poisson_arrivals(n: int, rate: float, seed: int) -> np.ndarray:
    """Arrival times (s) of a Poisson process of ``rate`` requests/s, the first at 0 (as
    ``vllm bench serve`` sends them); ``inf``: all at 0."""
    if math.isinf(rate):
        return np.zeros(n, dtype=np.float64)
    gaps = _rng(seed, _ARRIVAL_STREAM).exponential(1.0 / rate, size=n)
    out = np.zeros(n, dtype=np.float64)
    np.cumsum(gaps[:-1], out=out[1:])
    return out


def _rng(seed: int, *keys: int) -> np.random.Generator:
    # NOTE: masking keeps negative run seeds valid (SeedSequence wants non-negative entropy).
    return np.random.default_rng([int(seed) & (2**64 - 1), *keys])


def _salts(seed: int, stream: int, ids: np.ndarray) -> np.ndarray:
    return prefix.mix(np.uint64(int(seed) & (2**64 - 1)), stream, np.asarray(ids, dtype=np.uint64))


def _random_tokens(lens: np.ndarray, vocab_size: int, seed: int) -> np.ndarray:
    return _rng(seed, _PROMPT_STREAM).integers(0, vocab_size, size=int(lens.sum()), dtype=np.int64)


def _lengths_table(prompt, output, arrivals, cached, vocab_size, seed, with_tokens) -> RequestTable:
    """Random prompts of the given lengths: token ids drawn, or each keyed as its own."""
    n = len(prompt)
    table = RequestTable(prompt_lens=prompt, output_lens=output, arrival_steps=arrivals, cached_lens=cached)
    if with_tokens:
        table.tokens = _random_tokens(prompt, vocab_size, seed)
    else:
        table.identity = BlockIdentity(salts=_salts(seed, _PROMPT_STREAM, np.arange(n)))
    return table


def _synthetic(cfg: SyntheticWorkload, vocab_size: int, seed: int, with_tokens: bool) -> RequestTable:
    rng = _rng(seed, _SYNTHETIC_STREAM)
    n = cfg.num_requests
    prompt = rng.integers(cfg.prompt_len[0], cfg.prompt_len[1] + 1, size=n).astype(np.int64)
    output = rng.integers(cfg.output_len[0], cfg.output_len[1] + 1, size=n).astype(np.int64)
    every = 1.0 if cfg.arrival_every is None else cfg.arrival_every
    arrivals = np.floor(np.arange(n) * every).astype(np.int64)
    return _lengths_table(prompt, output, arrivals, np.zeros(n, dtype=np.int64), vocab_size, seed, with_tokens)


def _explicit(cfg: ExplicitWorkload, vocab_size: int, seed: int, with_tokens: bool) -> RequestTable:
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
        prompt = np.array([len(p) for p in prompts], dtype=np.int64)
    else:
        prompts = None
        prompt = np.asarray(cfg.prompt_lens, dtype=np.int64)
    n = len(prompt)
    output = np.asarray(cfg.output_lens * n if len(cfg.output_lens) == 1 else cfg.output_lens, dtype=np.int64)
    arrivals = np.asarray(cfg.arrival_steps if cfg.arrival_steps is not None else [0] * n, dtype=np.int64)
    cached = cfg.cached_lens or [0]
    cached = np.asarray(cached * n if len(cached) == 1 else cached, dtype=np.int64)
    if prompts is None:
        return _lengths_table(prompt, output, arrivals, cached, vocab_size, seed, with_tokens)
    # NOTE: a user's own ids are kept even simulating: they are what was typed, and they key the blocks.
    return RequestTable(prompt_lens=prompt, output_lens=output, arrival_steps=arrivals, cached_lens=cached,
                        tokens=np.concatenate(prompts))


# -- traces ---------------------------------------------------------------------------------

def _scale(length, scale: float):
    """ceil(length * scale), at least 1 (int, or int64 array)."""
    if isinstance(length, np.ndarray):
        return np.maximum(1, np.ceil(length * scale)).astype(np.int64)
    return max(1, math.ceil(length * scale))


# What a trace's null settings are in a run: executed, a tiny model on CPU ranks (1% of the
# lengths, the first 16 requests); simulated, a model card at scale (the trace as it is).
EXECUTED_TRACE = {"length_scale": 0.01, "max_requests": 16}
SIMULATED_TRACE = {"length_scale": 1.0, "max_requests": None}


def trace_as_run(cfg: TraceWorkload, simulated: bool) -> TraceWorkload:
    """``cfg`` with the settings it leaves null as the run takes them (``max_requests`` None
    once resolved: every request)."""
    defaults = SIMULATED_TRACE if simulated else EXECUTED_TRACE
    return cfg.model_copy(update={k: v for k, v in defaults.items() if getattr(cfg, k) is None})


def _trace_lengths(cfg: TraceWorkload, rec: TraceColumns) -> tuple[np.ndarray, np.ndarray]:
    s = cfg.length_scale
    prompt, output = _scale(rec.input_lens, s), _scale(rec.output_lens, s)
    if cfg.output_len_cap is not None:
        output = np.minimum(output, cfg.output_len_cap)
    return prompt, output


def _trace(cfg: TraceWorkload, vocab_size: int, seed: int, with_tokens: bool, simulated: bool) -> RequestTable:
    cfg = trace_as_run(cfg, simulated)
    rec = read_trace(cfg)
    s = cfg.length_scale
    n = len(rec.input_lens)
    prompt, output = _trace_lengths(cfg, rec)
    ts = rec.timestamps
    timed = simulated and cfg.step_ms is None
    if timed and math.isnan(ts[0]):
        raise trace_problem(cfg, "a trace with a timestamp on every line to replay it in time (a simulated run); "
                             f"{cfg.path} has none: add them, or give workload.step_ms to replay it in steps")
    rel = np.zeros(n) if math.isnan(ts[0]) else (ts - ts.min()) * cfg.time_scale
    if timed and rel.max() / 1e3 > MAX_ARRIVAL_S:
        span_ms = float(ts.max() - ts.min())
        raise ConfigError([Problem("workload.time_scale", cfg.time_scale,
                                   f"its requests arrive until ~{rel.max() / 1e3:.3g} s ({span_ms:g} ms of timestamps "
                                   f"x time_scale): {_WHY_MAX_ARRIVAL}; allowed: <= {MAX_ARRIVAL_S * 1e3 / span_ms:.3g} "
                                   "for these requests")])
    arrivals = np.floor(rel / cfg.ms_per_step).astype(np.int64)
    table = RequestTable(prompt_lens=prompt, output_lens=output, arrival_steps=arrivals,
                         cached_lens=np.zeros(n, dtype=np.int64), arrival_s=rel / 1e3 if timed else None)
    if not with_tokens:
        table.identity = BlockIdentity(salts=_salts(seed, _TRACE_TAIL_STREAM, cfg.skip + np.arange(n)),
                                       hash_ids=rec.hash_ids.astype(np.uint64), hash_starts=rec.hash_starts,
                                       trace_block_tokens=TRACE_BLOCK_TOKENS * s)
        return table
    block_tokens = _scale(TRACE_BLOCK_TOKENS, s)
    block_cache: dict[int, np.ndarray] = {}
    parts = []
    for i in range(n):
        hash_ids = rec.hash_ids[rec.hash_starts[i]:rec.hash_starts[i + 1]].tolist()
        prompt_len = int(prompt[i])
        # NOTE: block k covers scaled positions [floor(512 k s), floor(512 (k+1) s)): the
        # boundaries depend on k only, so equal hash-id prefixes give equal token prefixes.
        bounds = np.minimum(
            np.floor(np.arange(len(hash_ids) + 1) * TRACE_BLOCK_TOKENS * s).astype(np.int64),
            prompt_len,
        )
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
    table.tokens = np.concatenate(parts)
    return table


# --- request lengths (the driver's checks, pcpflow.driver.checks) ----------------------------------
def request_lengths(config: WorkloadConfig, *, seed: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(prompt lengths, output budgets) of ``build_requests``'s requests, without building
    a token array: the driver checks that a workload fits before anything allocates it.
    Raises the same ConfigErrors (trace file, prompt ids outside the vocabulary)."""
    table = request_table(config, vocab_size=vocab_size, seed=seed, with_tokens=False)
    return table.prompt_lens, table.output_lens
