"""Text in, text out: the checkpoint's tokenizer, chat template and EOS ids.

Prompts are tokenized once, in the driver (``tokenize_workload``, called by
``prepare_job``), and the ids travel in the frozen config (``workload.text_token_ids``):
ranks never load a tokenizer, and a rank started on another machine or with another
transformers version still runs exactly the ids the driver produced. Only rank 0 loads
the tokenizer again, at the end, to decode the outputs (``decode_outputs``).

EOS ids and the repetition penalty come from the checkpoint's ``generation_config.json``,
else its ``config.json`` (``eos_token_id``: one id or a list; ``repetition_penalty``), as
transformers' ``generate`` reads them.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

from pcpflow.errors import ConfigError, Problem, missing_extra

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
"""Any of these in the checkpoint directory means it brings a tokenizer."""


def _checkpoint_dir(model_config: Any) -> Path | None:
    path = getattr(model_config, "path", None)
    return Path(path) if getattr(model_config, "name", None) == "hf" and path else None


def has_tokenizer(model_config: Any) -> bool:
    path = _checkpoint_dir(model_config)
    return path is not None and any((path / f).is_file() for f in TOKENIZER_FILES)


@functools.cache
def load_tokenizer(path: str):
    """The checkpoint's tokenizer through transformers, offline (cached: the driver
    validates a job before Hydra runs it, and must not load it twice)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


class UnreadableGenerationFile(ValueError):
    """generation_config.json is there but not a JSON object: no setting of it can be read."""


def _generation_setting(model_config: Any, key: str) -> tuple[Any, Path | None]:
    """A generation setting of the checkpoint and the file it came from, as transformers'
    ``generate`` reads it: ``generation_config.json`` when the checkpoint has one (a key it
    leaves out is unset: transformers does not fall back to config.json then), else
    ``config.json``; ``(None, None)`` for tiny models. ValueError naming the file if
    generation_config.json is not a JSON object (the driver reports it before a run:
    ``generation_problems``)."""
    path = _checkpoint_dir(model_config)
    if path is None:
        return None, None
    for name in ("generation_config.json", "config.json"):
        file = path / name
        try:
            raw = json.loads(file.read_text())
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as exc:
            if name == "config.json":  # the checkpoint's own validation reports it
                return None, None
            raise UnreadableGenerationFile(f"{file} is not readable JSON, so its {key} cannot be read ({exc})") from None
        if not isinstance(raw, dict):
            if name == "config.json":
                return None, None
            raise UnreadableGenerationFile(f"{file} is not a JSON object, so its {key} cannot be read")
        return raw.get(key), file
    return None, None


def eos_token_ids(model_config: Any) -> list[int]:
    """The checkpoint's EOS ids (``eos_token_id`` of generation_config.json, else of
    config.json: ``_generation_setting``); [] for tiny models and checkpoints without one.
    ValueError naming the file and ``eos_token_id`` if it is not an id or a list of ids."""
    eos, file = _generation_setting(model_config, "eos_token_id")
    if eos is None:
        return []
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(e, int) and not isinstance(e, bool) for e in ids):
        raise ValueError(f"{file}: eos_token_id must be a token id or a list of token ids; got {eos!r}")
    return sorted(set(ids))


def repetition_penalty_of(model_config: Any) -> float:
    """The checkpoint's ``repetition_penalty`` (``_generation_setting``), 1.0 (off) without
    one. ValueError naming the file if it is not a number > 0."""
    penalty, file = _generation_setting(model_config, "repetition_penalty")
    if penalty is None:
        return 1.0
    if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not penalty > 0:
        raise ValueError(f"{file}: repetition_penalty must be a number > 0; got {penalty!r}")
    return float(penalty)


UNAPPLIED = {  # generation_config.json settings that change what transformers' generate picks, and their neutral value
    "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None, "min_length": 0,
    "min_new_tokens": None, "suppress_tokens": None, "begin_suppress_tokens": None, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "sequence_bias": None, "exponential_decay_length_penalty": None,
}


def unapplied_generation_settings(model_config: Any) -> dict[str, Any]:
    """The checkpoint's generation_config.json settings (``UNAPPLIED``) that would change
    transformers' greedy tokens and that pcpflow does not apply: those not at their neutral
    value. pcpflow applies ``eos_token_id`` and ``repetition_penalty``; temperature, top-k and
    top-p are ``sampling.*`` (0 = greedy, as ``generate(do_sample=False)``)."""
    path = _checkpoint_dir(model_config)
    try:
        raw = json.loads((path / "generation_config.json").read_text()) if path is not None else None
    except (OSError, ValueError):
        return {}  # absent, or reported by generation_problems
    if not isinstance(raw, dict):
        return {}
    return {k: raw[k] for k, neutral in UNAPPLIED.items() if raw.get(k) not in (neutral, None, [], {})}


def generation_problems(model_config: Any) -> list[Problem]:
    """The checkpoint's generation settings cannot be read (``eos_token_ids``,
    ``repetition_penalty_of``): a problem on ``model.path`` for each."""
    problems = []
    for read in (eos_token_ids, repetition_penalty_of):
        try:
            read(model_config)
        except ValueError as exc:
            problems.append(Problem("model.path", str(model_config.path), str(exc)))
            if isinstance(exc, UnreadableGenerationFile):
                break  # NOTE: one problem for the file, not one per setting
    return problems


def _ids(encoded: Any) -> list[int]:
    # NOTE: transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True)
    # by default, transformers 4 a list of ids.
    if isinstance(encoded, dict) or hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    if encoded and isinstance(encoded[0], list):
        encoded = encoded[0]
    return [int(t) for t in encoded]


def tokenize_texts(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text's ids, BOS as the tokenizer adds it."""
    return [_ids(tokenizer(t)["input_ids"]) for t in texts]


def tokenize_chats(tokenizer, chats: list[list[dict[str, str]]]) -> list[list[int]]:
    """Each conversation through the chat template with the generation prompt, tokenized
    by the template itself (no second BOS from re-tokenizing the rendered text)."""
    return [_ids(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True)) for c in chats]


def tokenize_workload(cfg):
    """``cfg`` with its texts / chats tokenized into ``workload.text_token_ids``
    (unchanged for other workloads); ConfigError without a usable tokenizer."""
    w = cfg.workload
    texts, chats = getattr(w, "texts", None), getattr(w, "chats", None)
    if texts is None and chats is None or cfg.mode in ("simulate", "search"):
        return cfg  # NOTE: a simulation prices lengths; its own checks refuse texts (simulate_problems)
    field = "workload.texts" if texts is not None else "workload.chats"
    given = texts if texts is not None else "<conversations>"
    if cfg.model.name != "hf":
        raise ConfigError([Problem(field, given, f"texts and chats need a checkpoint with a tokenizer "
                                   f"(model=hf model.path=DIR); model={cfg.model.name} has no tokenizer")])
    if not has_tokenizer(cfg.model):
        raise ConfigError([Problem(field, given, f"the checkpoint {cfg.model.path} has no tokenizer files "
                                   f"(any of {', '.join(TOKENIZER_FILES)}); give token ids with workload.prompts")])
    missing = missing_extra(("transformers",), "hf")
    if missing:
        raise ConfigError([Problem(field, given, f"texts and chats are tokenized by transformers; {missing}")])
    try:
        tokenizer = load_tokenizer(cfg.model.path)
    except Exception as exc:  # transformers raises many types for a broken tokenizer
        raise ConfigError([Problem("model.path", cfg.model.path, f"a loadable tokenizer; transformers says: {exc}")]) from None
    if texts is not None:
        ids = tokenize_texts(tokenizer, texts)
    else:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ConfigError([Problem(field, given, f"the tokenizer of {cfg.model.path} has no chat "
                                       "template; give workload.texts instead")])
        ids = tokenize_chats(tokenizer, [[m.model_dump() for m in c] for c in chats])
    empty = [i for i, p in enumerate(ids) if not p]
    if empty:
        raise ConfigError([Problem(field, given, f"texts that give >= 1 token; {empty} give none")])
    return cfg.model_copy(update={"workload": w.model_copy(update={"text_token_ids": ids})})


def decode_outputs(model_config: Any, outputs: list[list[int]]) -> list[str] | None:
    """Each request's generated text, special tokens (the EOS that ended it) left out;
    None without a tokenizer."""
    if not has_tokenizer(model_config):
        return None
    tokenizer = load_tokenizer(model_config.path)
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in outputs]


def stop_token_ids(model_config: Any, *, ignore_eos: bool) -> list[int]:
    """The ids that end a request: the checkpoint's EOS ids, or none with ``ignore_eos``."""
    return [] if ignore_eos else eos_token_ids(model_config)
