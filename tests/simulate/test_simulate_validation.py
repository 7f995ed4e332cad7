"""The simulator against Meta's given figures (scripts/validate_meta_cp.py): the two fitted
factors reproduce their figures and the fit gives the shipped values; every predicted
figure is within 10%, except the ones listed in ``MISSES`` (docs/simulate.md says why),
which are strict expected failures: should the model come to predict them, the test says so."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import validate_meta_cp as v  # noqa: E402

MISSES = {
    "TTFT CP2 x TP8, 8,192": "-10%: every CP row with little work per rank is low; no mechanism found",
    "TTFT CP16 x TP8, 131,072": "-26%: ~0.5 ms per ring step and layer the operators do not explain",
}
OPERATOR_MISSES = {
    (3_200, "pass-Q", "sendrecv"): "-11%: one fitted share for four transfer sizes",
    (3_200, "pass-Q", "all2all"): "-50%: a fixed ~210 us NCCL's point-to-point path does not explain",
    (12_800, "pass-Q", "all2all"): "-21%: the same fixed cost",
}


@pytest.fixture(scope="module")
def rows():
    return {r["what"]: r for r in v.table()}


@pytest.fixture(scope="module")
def operators():
    return {(r["new"], r["algorithm"]): r for r in v.operators()}


def test_two_factors_are_fitted_and_reproduce_their_figures(rows):
    from pcpflow.config.hardware import SimulateConfig

    assert set(SimulateConfig.FITTED) == {"gemm_efficiency", "p2p_efficiency"}
    assert abs(rows["TTFT CP1 x TP8, 8,192"]["error"]) < 0.005
    assert [r["role"] for r in rows.values()].count("predicted") == len(rows) - 1


def test_the_fit_gives_the_shipped_factors():
    from pcpflow.config.hardware import SimulateConfig

    fitted, shipped = v.fit(), SimulateConfig()
    assert fitted["gemm_efficiency"] == pytest.approx(shipped.gemm_efficiency, rel=5e-4)
    assert fitted["p2p_efficiency"] == pytest.approx(shipped.p2p_efficiency, rel=5e-4)
    assert "attention_efficiency" not in SimulateConfig.model_fields  # FlashAttention-3's figure: a source


def _case(what: str):
    reason = MISSES.get(what)
    return pytest.param(what, marks=pytest.mark.xfail(strict=True, reason=reason)) if reason else what


@pytest.mark.parametrize("what", [_case(f"TTFT CP{n} x TP8, {c:,}") for n, c, _, _ in v.PUBLISHED
                                  if (n, c) != (1, 8_192)] + [_case(f"TTIT TP8, {v.TTIT[1]:,}")])
def test_predicted_figures_within_10_percent(rows, what):
    assert abs(rows[what]["error"]) <= v.TOLERANCE, rows[what]


def _op(new, algo, column):
    reason = OPERATOR_MISSES.get((new, algo, column))
    return pytest.param(new, algo, column, marks=pytest.mark.xfail(strict=True, reason=reason)) if reason else (new, algo, column)


@pytest.mark.parametrize("new, algo, column", [_op(n, a, c) for n, a, s, t, x in v.OPERATORS
                                               for c, pub in (("sendrecv", s), ("attention", t), ("all2all", x))
                                               if pub])
def test_operator_table_within_10_percent(operators, new, algo, column):
    published, simulated = operators[(new, algo)][column]
    assert simulated == pytest.approx(published, rel=v.TOLERANCE)


@pytest.mark.slow
def test_held_out_shapes_show_the_physics_the_paper_describes():
    """The held-out shapes' predictions (no published value here): pass-Q wins at a 1% miss
    rate and pass-KV at 100%, ring_auto (Meta's rule) picks pass-Q at 1%, Meta's decode at 8K
    slows with every rank added, its attention kernel at 128K divides by the ranks while a hop
    costs the same at every ring size, and TP spread over nodes loses to CP on the same GPUs at every
    length."""
    text = v.held_out().splitlines()
    kv = [float(c.replace(",", "")) for c in text[4].strip("|").split("|")[1:]]
    q = [float(c.replace(",", "")) for c in text[5].strip("|").split("|")[1:]]
    assert text[4].startswith("| pass-KV") and text[5].startswith("| pass-Q")
    assert q[0] < kv[0] and kv[-1] < q[-1]
    assert text[6].split("|")[2].strip() == "pass-Q"
    # Meta's decode at 8K: attention is ~0.3 ms of a ~47 ms token, and each rank more adds a
    # query hop per layer: the ring only costs
    meta_8k = next(r for r in text if r.startswith("| 8,192 | sharded"))
    cp1, cp2, cp4 = (float(c) for c in meta_8k.strip("|").split("|")[2:])
    assert cp1 < cp2 < cp4
    # Meta's decode attention by operator at 128K: each rank holds 1/N of the KV, so the kernel
    # (bound by its reads) halves as N doubles; a hop carries one query and its new KV entry
    # whatever N; one rank's attention is its kernel alone
    ops = {r.split("|")[2].strip(): r.strip("|").split("|")[2:] for r in text if r.startswith("| 131,072 | CP")}
    attn = {k: float(c[0].replace(",", "")) for k, c in ops.items()}
    assert attn["CP1 x TP8"] / 2 == pytest.approx(attn["CP2 x TP8"], rel=0.05)
    assert attn["CP2 x TP8"] / 2 == pytest.approx(attn["CP4 x TP8"], rel=0.05)
    assert ops["CP2 x TP8"][1] == ops["CP4 x TP8"][1] and ops["CP1 x TP8"][1].strip() == "n/a"
    assert ops["CP1 x TP8"][0] == ops["CP1 x TP8"][3]
    tp_rows = [r for r in text if r.startswith(("| 8,192 |", "| 32,768 |", "| 131,072 |"))][-3:]
    for row in tp_rows:
        cp2, tp16, cp4, tp32 = (float(c.replace(",", "")) for c in row.strip("|").split("|")[1:])
        assert cp2 < tp16 and cp4 < tp32
