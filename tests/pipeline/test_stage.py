"""pcpflow.pipeline.stage: the registry fills from the built-ins, entry points and plugins,
idempotently, and refuses a second class under a taken kind."""

from __future__ import annotations

import pytest

from pcpflow.pipeline.assemble import load_stages
from pcpflow.pipeline.stage import (
    Stage,
    UnknownStageError,
    known_kinds,
    load_entry_points,
    register,
    resolve,
)


def test_registry_builtins_plugins_module_class_and_idempotence():
    load_stages(["pcpflow_test_plugins.probes"])
    load_stages(["pcpflow_test_plugins.probes"])  # every rank imports plugins: no-op
    builtin = {"batch_checks", "dual_chunk_swap", "persistent", "paged", "model", "all_rows", "sampled_rows",
               "none", "mtp", "dspark", "self"}
    assert builtin <= set(known_kinds())
    assert set(known_kinds("restore")) & builtin == {"all_rows", "sampled_rows"}
    assert set(known_kinds("draft")) & builtin == {"none", "mtp", "dspark", "self"}
    probe = resolve("test_call_counter")
    assert resolve("pcpflow_test_plugins.probes:CallCounter") is probe
    register(probe)  # the same class again: fine

    class Impostor(probe):  # another class under a taken kind: refused
        kind = "test_call_counter"

    with pytest.raises(ValueError, match="registered twice"):
        register(Impostor)


def test_unknown_kinds_and_wrong_slots_name_what_is_known():
    load_stages()
    with pytest.raises(UnknownStageError) as exc:
        resolve("sampled_row", "restore")
    assert str(exc.value).startswith("unknown stage kind 'sampled_row' for slot 'restore' (did you mean 'sampled_rows'?)")
    with pytest.raises(UnknownStageError) as exc:
        resolve("dual_chunk_swap", "restore")
    assert "cannot fill slot 'restore' (it fills plan)" in str(exc.value)
    with pytest.raises(UnknownStageError, match="is not a pcpflow Stage subclass"):
        resolve("pcpflow.layouts.layout:plan_layout")


def test_register_needs_a_stage_with_a_kind():
    with pytest.raises(TypeError, match="expects a Stage subclass"):
        register(int)

    class NoKind(Stage):
        pass

    with pytest.raises(TypeError, match="non-empty class attribute 'kind'"):
        register(NoKind)


def test_entry_point_group_registers_stages(tmp_path, monkeypatch):
    dist = tmp_path / "pcpflow_demo_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: pcpflow-demo-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[pcpflow.stages]\ncounter = pcpflow_test_plugins.probes:CallCounter\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "counter" in load_entry_points()
    assert resolve("test_call_counter").__name__ == "CallCounter"
