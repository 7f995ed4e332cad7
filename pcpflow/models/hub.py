"""Checkpoints named by their Hugging Face Hub id: ``model.path=Qwen/Qwen2.5-0.5B-Instruct``.

A ``model.path`` that is a directory is read as it is. Any other of the Hub's ``owner/name``
form (``owner/name@revision`` for a branch, tag or commit) is the snapshot ``huggingface_hub``
keeps of that repository in the Hugging Face cache (``HF_HOME``, ``HF_HUB_CACHE``), with what
is missing downloaded first unless ``HF_HUB_OFFLINE=1`` (then the cache alone answers):
config.json alone for a simulated run, which reads nothing else; for an executed run the
generation config, the tokenizer and the safetensors files the index names too (never a
repository's other formats: ``.bin``, ``original/``, GGUF, Mistral's consolidated file).

It runs once, in the driver, when the config is validated: the ranks are handed the snapshot
directory. A name that is neither gives one configuration error on ``model.path`` (exit 2)
saying both: no such directory, and what the Hub or the cache answered.

Online, the download runs in a child Python (``python -m pcpflow.models.hub``) whose progress
bars show on stderr: ``huggingface_hub`` fetches with threads that would hold the
driver's exit until their files are done, while a child is killed the moment the driver is
interrupted (Ctrl-C, SIGTERM; a later run resumes its partial files).
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from pcpflow.errors import missing_extra

REPO_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?:@(?P<revision>[\w./-]+))?$")
"""``owner/name`` as the Hub spells a model repository, then an optional ``@revision``."""

CONFIG_FILES = ("config.json",)
"""What a simulated run reads."""
RUN_FILES = CONFIG_FILES + (
    "generation_config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
    "tokenizer.model", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
    "chat_template.jinja", "chat_template.json",
)
"""What an executed run reads besides its weights (the files a repository has of these)."""
INDEX_FILE, SINGLE_FILE = "model.safetensors.index.json", "model.safetensors"


def resolve_checkpoint(path: str, *, weights: bool) -> str:
    """The checkpoint directory ``path`` names: itself (made absolute) when it is one, else
    the cached snapshot of the Hub repository it names, with what a run reads (``weights``:
    an executed run's files too) downloaded when missing. ValueError saying what is wrong."""
    local = Path(os.path.expanduser(path)).absolute()
    match = REPO_ID.fullmatch(path.strip())
    if local.exists() or match is None:
        return str(local)
    missing = missing_extra(("huggingface_hub",), "hf")
    if missing:
        raise ValueError(f"no checkpoint directory at {local}, and {path} read as a Hugging Face Hub id needs "
                         f"huggingface_hub: {missing}")
    from huggingface_hub import constants

    offline = bool(constants.HF_HUB_OFFLINE)
    try:
        return _snapshot(match["repo"], match["revision"], weights, offline)
    except LookupError as exc:
        where = "the Hugging Face cache (HF_HUB_OFFLINE=1)" if offline else "the Hugging Face Hub or its cache"
        raise ValueError(f"no checkpoint directory at {local}, and {path} could not be read from {where}: {exc}") from None


@functools.cache
def _snapshot(repo: str, revision: str | None, weights: bool, offline: bool) -> str:
    """``fetch``'s snapshot, once a process (a search validates every layout, a sweep every job,
    with one model.path); LookupError with what the Hub or the cache answered (not kept)."""
    answer = (fetch if offline else _fetch_in_child)(repo, revision, weights=weights)
    if "error" in answer:
        raise LookupError(answer["error"])
    return answer["snapshot"]


def fetch(repo: str, revision: str | None, *, weights: bool) -> dict[str, str]:
    """``{"snapshot": directory}`` of ``repo`` at ``revision`` once what a run reads is in the
    cache, or ``{"error": what the Hub or the cache answered}``."""
    try:
        snapshot = _download(repo, revision, list(RUN_FILES if weights else CONFIG_FILES))
        if weights:
            _download(repo, revision, _weight_files(Path(snapshot)))
    except Exception as exc:  # NOTE: the Hub's own errors (not found, gated, offline, network) say what is wrong
        return {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())}"}
    return {"snapshot": snapshot}


def _fetch_in_child(repo: str, revision: str | None, *, weights: bool) -> dict[str, str]:
    """``fetch`` in a child Python (its stderr, the progress bars, passed through): killed
    at once if this one is interrupted (``subprocess.run`` kills it on any exception)."""
    argv = [sys.executable, "-m", "pcpflow.models.hub", repo, revision or "", "weights" if weights else "config"]
    done = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=False)
    lines = done.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, ValueError):
        return {"error": f"the download ({' '.join(argv[1:])}) ended with exit code {done.returncode} and no answer"}


def _download(repo: str, revision: str | None, files: list[str]) -> str:
    """The snapshot directory of ``repo`` at ``revision`` in the cache, holding those of ``files``
    the repository has (cached ones are not fetched again)."""
    from huggingface_hub import snapshot_download

    return snapshot_download(repo, revision=revision, allow_patterns=files)


def _weight_files(snapshot: Path) -> list[str]:
    """The safetensors files a checkpoint's index names (``model.safetensors`` without one)."""
    index = snapshot / INDEX_FILE
    if not index.is_file():
        return [SINGLE_FILE]
    try:
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{index} is not a safetensors index ({exc})") from None


if __name__ == "__main__":  # the child of _fetch_in_child: python -m pcpflow.models.hub REPO REVISION weights|config
    _repo, _revision, _what = sys.argv[1:4]
    print(json.dumps(fetch(_repo, _revision or None, weights=_what == "weights")), flush=True)
