"""Seeded sampling: the keyed draws follow softmax(logits / T), and every layout draws
the same tokens as one rank.

The unit tests check the sampler against independent numpy arithmetic (softmax, the
top-k / top-p sets worked out by sorting) with chi-square tests over many keyed draws
(fixed seed: deterministic, cannot flake), and the keyed uniforms with a KS test. The engine tests run tiny models: the same
seed gives the same ids at pcp=1 and at pcp=4 dcp=4 decode=sharded (float64, verified
exact), speculative decoding under sampling gives the ids of decoding without drafts,
and temperature -> 0 and top_k=1 give the greedy ids.
"""

from __future__ import annotations

import numpy as np
import pytest
import shared_ranks
import torch

from pcpflow.testing import compose
from pcpflow.tokens.sampling import SamplingConfig, decision_gap, keyed_uniform, sample

ROW = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5])  # a fixed logits row
N_DRAWS = 40_000


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def draw_counts(config: SamplingConfig, seed: int = 7, row: np.ndarray = ROW) -> np.ndarray:
    """Token counts of N_DRAWS keyed draws from ``row``: one request, positions 0..N-1."""
    logits = torch.tensor(np.tile(row, (N_DRAWS, 1)))
    tokens = sample(logits, config, seed, np.zeros(N_DRAWS, np.int64), np.arange(N_DRAWS))
    return np.bincount(tokens, minlength=len(row))


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    support = probs > 0
    assert counts[~support].sum() == 0, f"draws outside the kept set: {counts}"
    expected = probs[support] * counts.sum()
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    # chi-square survival function: the regularized upper incomplete gamma Q(df/2, chi2/2)
    a, x = torch.tensor([df / 2, chi2 / 2], dtype=torch.float64)
    return float(torch.special.gammaincc(a, x))


def ks_uniform_pvalue(x: np.ndarray) -> float:
    """Kolmogorov-Smirnov p-value of ``x`` against U(0, 1): the statistic D = sup|F_n - F|
    and Kolmogorov's asymptotic law P(sqrt(n) D > t) = 2 sum_k (-1)^(k-1) exp(-2 k^2 t^2)."""
    x = np.sort(x)
    n = len(x)
    d = max((np.arange(1, n + 1) / n - x).max(), (x - np.arange(n) / n).max())
    t = np.sqrt(n) * d
    k = np.arange(1, 101)
    return float(np.clip(2 * np.sum((-1.0) ** (k - 1) * np.exp(-2 * k**2 * t**2)), 0.0, 1.0))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_draws_follow_softmax_over_temperature(temperature):
    counts = draw_counts(SamplingConfig(temperature=temperature))
    assert chi2_pvalue(counts, softmax(ROW / temperature)) > 1e-3
    # the test has power: the distribution at another temperature is rejected outright
    other = softmax(ROW / (temperature * 1.5))
    assert chi2_pvalue(counts, other) < 1e-12


def test_top_k_and_top_p_renormalize_over_the_kept_tokens():
    t = 0.8
    p = softmax(ROW / t)
    # top_k=3: tokens 0 (2.0), 7 (1.5), 1 (1.0)
    keep = np.zeros(len(ROW), bool)
    keep[[0, 7, 1]] = True
    want = np.where(keep, p, 0) / p[keep].sum()
    assert chi2_pvalue(draw_counts(SamplingConfig(temperature=t, top_k=3)), want) > 1e-3
    # top_p: the fewest most likely tokens whose mass reaches top_p
    order = np.argsort(-p)
    cum = np.cumsum(p[order])
    n_keep = int(np.searchsorted(cum, 0.8) + 1)
    keep = np.zeros(len(ROW), bool)
    keep[order[:n_keep]] = True
    assert 1 < n_keep < len(ROW)
    want = np.where(keep, p, 0) / p[keep].sum()
    assert chi2_pvalue(draw_counts(SamplingConfig(temperature=t, top_p=0.8)), want) > 1e-3


def test_draws_are_a_function_of_seed_request_and_position():
    seed = 3
    req = torch.tensor([0, 1, 2, 1])
    pos = torch.tensor([5, 5, 9, 5])
    u = keyed_uniform(seed, req, pos)
    assert u[1] == u[3]  # same key, another row of the batch: the same uniform
    assert len(set(u[:3].tolist())) == 3
    assert keyed_uniform(seed, req[2:3], pos[2:3])[0] == u[2]  # alone as in the batch
    assert (keyed_uniform(seed + 1, req, pos) != u).all()
    # uniform over many keys, and no correlation between neighbouring positions
    many = keyed_uniform(seed, torch.zeros(20_000, dtype=torch.int64), torch.arange(20_000)).numpy()
    assert 0 < many.min() and many.max() < 1
    assert ks_uniform_pvalue(many) > 1e-3
    assert ks_uniform_pvalue(many**1.1) < 1e-9  # the test has power: a slight skew is rejected
    assert abs(np.corrcoef(many[:-1], many[1:])[0, 1]) < 0.03


COLD = 1e-7
"""A temperature at which softmax(logits / T) is exactly one-hot in float64 wherever the
top-2 gap exceeds 800 * T (exp(-800) underflows to 0)."""


def test_temperature_zero_and_top_k_one_are_greedy():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn((500, 50), generator=gen, dtype=torch.float64) * 2
    argmax = logits.argmax(dim=-1).numpy()
    req, pos = np.arange(500), np.arange(500) + 3
    assert (sample(logits, SamplingConfig(), 0, req, pos) == argmax).all()
    assert (sample(logits, SamplingConfig(temperature=1.5, top_k=1), 0, req, pos) == argmax).all()
    top2 = logits.topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 800 * COLD
    assert (sample(logits, SamplingConfig(temperature=COLD), 0, req, pos) == argmax).all()
    # and at T = 1 the draws do differ from greedy (the checks above are not vacuous)
    assert (sample(logits, SamplingConfig(temperature=1.0), 0, req, pos) != argmax).sum() > 100


def test_decision_gap_is_the_distance_to_the_interval_edge():
    t, seed, req, pos = 0.5, 4, 2, 11
    cdf = np.cumsum(softmax(ROW / t))
    u = float(keyed_uniform(seed, torch.tensor([req]), torch.tensor([pos]))[0])
    want = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    assert sample(torch.tensor(ROW[None]), SamplingConfig(temperature=t), seed, [req], [pos])[0] == want
    cfg = SamplingConfig(temperature=t)
    if want + 1 < len(ROW):
        assert decision_gap(torch.tensor(ROW), want + 1, want, cfg, seed, req, pos) == pytest.approx(
            t / 2 * (cdf[want] - u * cdf[-1]))
    if want > 0:
        assert decision_gap(torch.tensor(ROW), want - 1, want, cfg, seed, req, pos) == pytest.approx(
            t / 2 * (u * cdf[-1] - cdf[want - 1]))
    assert decision_gap(torch.tensor(ROW), 7, 0, SamplingConfig(), seed, req, pos) == pytest.approx(0.5)


def test_decision_gap_of_a_kept_set_that_nearly_changed():
    """top-p and top-k: a token the reference dropped is a near-tie by how far it was from being
    kept, and a draw between kept tokens also by how near the kept set was to another (a bigger
    or smaller set renormalizes every edge). Probabilities 0.5, 0.3, 0.2 at T = 1 (hand-worked
    masses before each token: 0, 0.5, 0.8)."""
    row = torch.log(torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64))
    seed, req, pos = 1, 0, 5
    # top_p = 0.75 keeps tokens 0 and 1; token 2 has 0.8 before it: 0.05 past the cut, T/2 x 0.05
    cfg = SamplingConfig(temperature=1.0, top_p=0.75)
    assert decision_gap(row, 2, 0, cfg, seed, req, pos) == pytest.approx(0.025)
    # top_p = 0.79: token 2 only 0.01 past it, so a draw between the kept tokens is a near-tie
    # at 0.005 wherever u lies
    cfg = SamplingConfig(temperature=1.0, top_p=0.79)
    u = float(keyed_uniform(seed, torch.tensor([req]), torch.tensor([pos]))[0])
    edge = 0.5 / 0.8  # the kept set's CDF after token 0, renormalized
    assert decision_gap(row, 1, 0, cfg, seed, req, pos) == pytest.approx(min(0.5 * abs(u - edge), 0.005))
    assert decision_gap(row, 0, 1, cfg, seed, req, pos) == pytest.approx(min(0.5 * abs(u - edge), 0.005))
    # top_k = 2 of logits 3, 2, 1, 0: token 2 is 1.0 below the 2nd logit; between tokens 0 and
    # 1 the cut is 1.0 away too
    four = torch.tensor([3.0, 2.0, 1.0, 0.0], dtype=torch.float64)
    cfg = SamplingConfig(temperature=2.0, top_k=2)
    assert decision_gap(four, 2, 0, cfg, seed, req, pos) == pytest.approx(1.0)
    assert decision_gap(four, 1, 0, cfg, seed, req, pos) <= 1.0


# ----------------------------------------------------------------- engine, every layout
BASE = [
    "model=tiny_mla",
    "dtype=float64",
    "workload=synthetic",
    "workload.num_requests=4",
    "workload.prompt_len=[5,30]",
    "workload.output_len=[5,8]",
    "scheduler.max_num_batched_tokens=48",
    "output.plots=false",
    "output.progress=false",
]
SAMPLED = ["sampling.temperature=0.8", "sampling.top_p=0.9", "sampling.seed=1"]


CASES = {
    "sampling/single": {
        "greedy": ["pcp=1", "output.save_logits=true"],
        "pcp1": ["pcp=1", *SAMPLED],
        "pcp1_seed2": ["pcp=1", *SAMPLED[:-1], "sampling.seed=2"],
        "pcp1_cold": ["pcp=1", f"sampling.temperature={COLD}"],
        "pcp1_top_k1": ["pcp=1", "sampling.temperature=1.0", "sampling.top_k=1"],
    },
    "sampling/multi": {
        "pcp4_dcp4_sharded": ["pcp=4", "dcp=4", "decode=sharded", *SAMPLED],
        "pcp4_dcp4_sharded_self_draft": [
            "pcp=4", "dcp=4", "decode=sharded", "draft=self", "draft.error_rate=0.3", *SAMPLED,
        ],
    },
    "sampling/narrow": {"pcp4_float32": ["pcp=4", "dcp=4", "decode=sharded", "dtype=float32", *SAMPLED]},
}
for _name, _cases in CASES.items():  # run in the session's shared ranks (tests/shared_ranks.py)
    shared_ranks.matrix(_name)(lambda c=_cases: [compose(BASE + extra) for extra in c.values()])


def _results(shared_runs, name: str) -> dict[str, dict]:
    return {case: result for case, (_, result) in zip(CASES[name], shared_runs[name])}


@pytest.fixture(scope="module")
def single(shared_runs):
    return _results(shared_runs, "sampling/single")


@pytest.fixture(scope="module")
def multi(shared_runs):
    return _results(shared_runs, "sampling/multi")


@pytest.fixture(scope="module")
def narrow(shared_runs):
    return _results(shared_runs, "sampling/narrow")


@pytest.mark.dist
@pytest.mark.matrix("sampling/single", "sampling/multi")
def test_same_seed_same_ids_under_every_layout(single, multi):
    results = {**single, **multi}
    ref = results["pcp1"]["outputs"]
    assert results["pcp4_dcp4_sharded"]["outputs"] == ref
    for name in ("pcp1", "pcp4_dcp4_sharded", "pcp4_dcp4_sharded_self_draft"):
        v = results[name]["verify"]
        assert v["passed"] and v["num_token_mismatches"] == 0 and not v["near_ties"], (name, v)
    # sampling is not greedy, and another seed draws other tokens
    assert ref != results["greedy"]["outputs"]
    assert ref != results["pcp1_seed2"]["outputs"]


@pytest.mark.dist
@pytest.mark.matrix("sampling/single", "sampling/multi")
def test_speculative_decoding_under_sampling_gives_the_ids_without_drafts(single, multi):
    r = multi["pcp4_dcp4_sharded_self_draft"]
    assert r["outputs"] == single["pcp1"]["outputs"]
    m = r["metrics"]
    assert 0 < m["acceptance_rate"] < 1, m["acceptance_rate"]  # drafts both accepted and rejected


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.matrix("sampling/narrow")
def test_float32_sampling_verifies(narrow):
    v = narrow["pcp4_float32"]["verify"]
    assert v["passed"], v


@pytest.mark.matrix("sampling/single")
def test_cold_and_top_k_one_equal_greedy(single):
    results = single
    greedy = results["greedy"]
    gaps = [np.sort(np.asarray(row))[-2:] for req in greedy["logits"] for row in req]
    assert min(b - a for a, b in gaps) > 800 * COLD  # see COLD
    assert results["pcp1_cold"]["outputs"] == greedy["outputs"]
    assert results["pcp1_top_k1"]["outputs"] == greedy["outputs"]
