"""``model.path=owner/name``: a checkpoint named by its Hugging Face Hub id is its snapshot in the
Hugging Face cache, with what a run reads fetched when missing (``pcpflow.models.hub``).

No Hub is reachable where these tests run: the cache is laid out here as ``huggingface_hub``
keeps it (``models--owner--name/refs/main`` naming a snapshot), read offline; what a run fetches
is checked against a stand-in Hub that serves a repository's files by ``allow_patterns`` as
``snapshot_download`` does.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs transformers to build checkpoints: pip install -e '.[test]'")
huggingface_hub = pytest.importorskip("huggingface_hub")

from repo_scripts import load_script  # noqa: E402

from pcpflow.errors import ConfigError  # noqa: E402
from pcpflow.models import hub  # noqa: E402
from pcpflow.testing import compose  # noqa: E402

script = load_script("make_tiny_hf_checkpoint")
SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny Llama checkpoint directory, sharded with an index (two shards), plus the other
    formats a real repository carries beside it."""
    path = script.build_checkpoint(tmp_path_factory.mktemp("hub") / "tiny", "llama")
    from safetensors.torch import load_file, save_file

    (single,) = path.glob("*.safetensors")
    tensors = load_file(single)
    single.unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(path / file))
    weight_map = {n: file for file, part in shards.items() for n in part}
    (path / hub.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "consolidated.safetensors").write_bytes(b"not for pcpflow")
    (path / "pytorch_model.bin").write_bytes(b"nor this")
    (path / "original").mkdir()
    (path / "original" / "params.json").write_text("{}")
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Iterator[Path]:
    """An empty Hugging Face cache, offline (``HF_HUB_CACHE``, ``HF_HUB_OFFLINE=1``)."""
    root = tmp_path / "hf-cache"
    root.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    hub._snapshot.cache_clear()  # NOTE: what an earlier test's cache answered is not this one's
    yield root
    hub._snapshot.cache_clear()


def _cached(cache: Path, repo: str, src: Path) -> Path:
    """``src`` as the cache holds ``repo``'s main branch at commit SHA."""
    entry = cache / f"models--{repo.replace('/', '--')}"
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text(SHA)
    snapshot = entry / "snapshots" / SHA
    shutil.copytree(src, snapshot)
    return snapshot


def test_a_hub_id_runs_its_cached_snapshot(tiny, cache):
    """Executed and simulated runs of ``acme/tiny-llama`` (and ``@main``, ``@<commit>``) read the
    snapshot: the ranks are handed its directory, and the simulated card is the directory's."""
    snapshot = _cached(cache, "acme/tiny-llama", tiny)
    for name in ("acme/tiny-llama", "acme/tiny-llama@main", f"acme/tiny-llama@{SHA}"):
        assert compose(["model=hf", f"model.path={name}", "pcp=2"]).model.path == str(snapshot)
    sim = ["mode=simulate", "hardware=h100_sxm"]
    by_id = compose([*sim, "model=hf", "model.path=acme/tiny-llama"]).model
    by_dir = compose([*sim, "model=hf", f"model.path={tiny}"]).model
    assert by_id.model_dump(exclude={"source"}) == by_dir.model_dump(exclude={"source"})
    assert by_id.source == str(snapshot / "config.json")


def test_a_directory_wins_over_a_hub_id_of_the_same_spelling(tiny, cache, tmp_path, monkeypatch):
    """``owner/name`` that is a directory under the working directory is that directory."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny, tmp_path / "acme" / "tiny-llama")
    _cached(cache, "acme/tiny-llama", tiny)
    assert compose(["model=hf", "model.path=acme/tiny-llama", "pcp=1"]).model.path == str(tmp_path / "acme" / "tiny-llama")


@pytest.mark.parametrize("path", ["acme/not-cached", "acme/tiny-llama@no-such-branch", "./acme/nowhere"])
def test_a_name_that_is_neither_is_one_problem_saying_both(tiny, cache, path):
    """Offline, a Hub id the cache lacks (or a branch it never saw) is one problem on model.path
    naming the missing directory and what the cache answered; a path that is no Hub id says the
    directory alone. Nothing runs."""
    _cached(cache, "acme/tiny-llama", tiny)
    for mode in ([], ["mode=simulate", "hardware=h100_sxm"]):
        with pytest.raises(ConfigError) as exc:
            compose([*mode, "model=hf", f"model.path={path}", "pcp=1"])
        (problem,) = exc.value.problems
        assert problem.field == "model.path" and "acme/" in problem.allowed
        if path.startswith("./"):
            assert "Hub" not in problem.allowed and "cache" not in problem.allowed
        else:
            assert "no checkpoint directory" in problem.allowed and path in problem.allowed
            assert "Hugging Face cache (HF_HUB_OFFLINE=1)" in problem.allowed


def test_a_run_fetches_only_what_it_reads(tiny, cache, monkeypatch):
    """From a Hub that serves every file of the repository: a simulated run fetches config.json
    alone; an executed run its configs, tokenizer files and the shards the index names, never
    the repository's other formats (consolidated.safetensors, .bin, original/)."""
    snapshot = cache / "models--acme--tiny-llama" / "snapshots" / SHA
    fetched: list[list[str]] = []

    def serve(repo, revision, files):  # snapshot_download's allow_patterns, from a repository that is `tiny`
        assert (repo, revision) == ("acme/tiny-llama", None)
        got = sorted(str(p.relative_to(tiny)) for p in tiny.rglob("*")
                     if p.is_file() and any(fnmatch.fnmatch(str(p.relative_to(tiny)), f) for f in files))
        for name in got:
            (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(tiny / name, snapshot / name)
        fetched.append(got)
        return str(snapshot)

    monkeypatch.setattr(hub, "_download", serve)
    for _ in range(3):  # NOTE: once a process, as a search validates each layout
        compose(["mode=simulate", "hardware=h100_sxm", "model=hf", "model.path=acme/tiny-llama"])
    assert fetched == [["config.json"]]
    fetched.clear()
    assert compose(["model=hf", "model.path=acme/tiny-llama", "pcp=1"]).model.path == str(snapshot)
    configs, shards = fetched
    assert {"config.json", hub.INDEX_FILE} <= set(configs) and not any(f.endswith((".bin", ".safetensors")) for f in configs)
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert not (snapshot / "consolidated.safetensors").exists() and not (snapshot / "original").exists()


@pytest.mark.slow  # NOTE: two child Pythons that import torch: seconds of the default set's budget
def test_the_download_child_answers_as_the_driver_would(tiny, cache, monkeypatch):
    """Online the driver fetches in a child Python (``python -m pcpflow.models.hub``: killed at once
    when the driver is interrupted); its answer is ``fetch``'s, here from the cache it is handed
    through the environment (offline: no Hub is reachable)."""
    snapshot = _cached(cache, "acme/tiny-llama", tiny)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub._fetch_in_child("acme/tiny-llama", SHA, weights=True) == {"snapshot": str(snapshot)}
    answer = hub._fetch_in_child("acme/not-cached", None, weights=False)
    assert list(answer) == ["error"] and "LocalEntryNotFoundError" in answer["error"]
