"""The simulator against Meta's published TTFTs (scripts/validate_meta_cp.py): the two
fitted figures are reproduced by the shipped factors, and the eight predictions hold
within 15%."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import validate_meta_cp as v  # noqa: E402


@pytest.fixture(scope="module")
def rows():
    return {(r["nodes"], r["context"]): r for r in v.table()}


def test_two_figures_are_fitted_and_reproduced(rows):
    assert len(v.FITTED) == 2
    for key in v.FITTED:
        assert abs(rows[key]["error"]) < 0.005, rows[key]


def test_the_fit_gives_the_shipped_efficiencies():
    from pcpflow.config.hardware import SimulateConfig

    fitted, shipped = v.fit(), SimulateConfig()
    assert fitted["gemm_efficiency"] == pytest.approx(shipped.gemm_efficiency, rel=0.01)
    assert fitted["ring_step_us"] == pytest.approx(shipped.ring_step_us, rel=0.01)
    # not fitted: the paper's FlashAttention-3 figure, 540 TF/s of the 800 TF/s peak (sec. 4.2.3)
    assert shipped.attention_efficiency == pytest.approx(540 / 800)


@pytest.mark.parametrize("key", [(n, c) for n, c, _, _ in v.PUBLISHED if (n, c) not in v.FITTED])
def test_predictions_within_15_percent(rows, key):
    r = rows[key]
    assert abs(r["error"]) <= v.TOLERANCE, r


@pytest.mark.slow
def test_held_out_shapes_show_the_physics_the_paper_describes():
    """The held-out shapes' predictions (no published value here): pass-Q wins at a 1% miss
    rate and pass-KV at 100% (Equation 1's side of 2 * 8/128), and TP spread over nodes
    loses to CP on the same GPUs at every length."""
    text = v.held_out().splitlines()
    kv = [float(c.replace(",", "")) for c in text[4].strip("|").split("|")[1:]]
    q = [float(c.replace(",", "")) for c in text[5].strip("|").split("|")[1:]]
    assert text[4].startswith("| pass-KV") and text[5].startswith("| pass-Q")
    assert q[0] < kv[0] and kv[-1] < q[-1]
    tp_rows = [r for r in text if r.startswith("| 8,192 |") or r.startswith("| 32,768 |") or r.startswith("| 131,072 |")]
    for row in tp_rows[-3:]:
        cp2, tp16, cp4, tp32 = (float(c.replace(",", "")) for c in row.strip("|").split("|")[1:])
        assert cp2 < tp16 and cp4 < tp32
