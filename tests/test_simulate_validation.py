"""The simulator against Meta's published TTFTs (scripts/validate_meta_cp.py): the two
fitted figures are reproduced by the shipped efficiencies, and the predictions hold within
15% — except the one the model is known to miss (docs/simulate.md says why)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import validate_meta_cp as v  # noqa: E402

KNOWN_MISS = {(16, 131_072)}  # CP16 at 128K: 8K tokens per rank; see docs/simulate.md


@pytest.fixture(scope="module")
def rows():
    return {(r["nodes"], r["context"]): r for r in v.table()}


def test_two_figures_are_fitted_and_reproduced(rows):
    assert len(v.FITTED) == 2
    for key in v.FITTED:
        assert abs(rows[key]["error"]) < 0.005, rows[key]


def test_the_fit_gives_the_shipped_efficiencies():
    from pcpflow.simulate.settings import SimulateConfig

    fitted, shipped = v.fit(), SimulateConfig()
    assert fitted["gemm_efficiency"] == pytest.approx(shipped.gemm_efficiency, rel=0.01)
    assert fitted["attention_efficiency"] == pytest.approx(shipped.attention_efficiency, rel=0.01)


@pytest.mark.parametrize("key", [(n, c) for n, c, _, _ in v.PUBLISHED if (n, c) not in v.FITTED])
def test_predictions_within_15_percent(rows, key):
    r = rows[key]
    if key in KNOWN_MISS:
        pytest.xfail(f"known miss: simulated {r['simulated_ms']:.0f} ms vs published {r['published_ms']} ms")
    assert abs(r["error"]) <= v.TOLERANCE, r
