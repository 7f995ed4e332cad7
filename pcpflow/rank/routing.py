"""Verifying a mixture-of-experts run: the reference routes as the run did at near-ties.

A router picks each row's top-k experts from its logits. Where two experts' scores nearly
tie, the rounding of a TP sum or a DCP merge (bf16) can make the run pick another expert than
the single-rank reference, and that row's output then differs by far more than the
tolerance: one near-tie would fail the whole run, and every layer after it would drift. The
verifier treats it as it treats a near-tie between two tokens:

- every rank records the router logits of every MoE layer of the rows it writes (each token
  has one such row over the PCP ranks; ``RecordRouting``, the forward's ``RoutingHook``);
  after the step they are summed over PCP in the batch's token order (``gather``);
- the reference routes each row from its own logits (``ForcedRouting``); where the run chose
  other experts, it takes the run's choice (its weights from the reference's own logits) if
  the row's router logits agree within the tolerance (then the run's choice is the router's
  on logits within rounding of the reference's): a *routing near-tie*, listed. Otherwise it
  keeps its own choice and the row is a routing mismatch (verification fails). float64 has
  no allowance, as for tokens.

Router logits are logits: they are held to the run's logit tolerance (``logits_atol``).
A position's entries depend on its tokens and every token before it, so each near-tie taken
is remembered under the chained key of that prefix (``prefix_keys``) and its layer: where the
reference recomputes positions the run reuses (a prefix hit, a readmission finding its own
blocks), it routes them as the run did when it wrote them (``RecalledRouting``).
"""

from __future__ import annotations

import numpy as np
import torch

from pcpflow.models.moe import MoEMLP
from pcpflow.parallel.comm import Comm
from pcpflow.scheduling import prefix

MAX_LISTED = 20


def prefix_keys(tokens: np.ndarray) -> np.ndarray:
    """A key of every prefix ``tokens[:p+1]``: the prefix cache's chained hash
    (``pcpflow.scheduling.prefix``) over blocks of one token."""
    return prefix.keys(prefix.chain(prefix.token_contents(tokens, 1)))


class RecordRouting:
    """The run's routing: as the router does, keeping the router logits of the rows this rank
    writes, per MoE layer (the step's first forward of a layer: the target's)."""

    def __init__(self) -> None:
        self.rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (tokens, logits)

    def for_rows(self, tokens: np.ndarray):
        """The hook for a forward whose routed rows are these batch tokens (-1: not this
        rank's to record; ``moe_dispatch._row_tokens``)."""
        keep = np.flatnonzero(tokens >= 0)
        rows, toks = torch.from_numpy(keep), torch.from_numpy(tokens[keep])

        def hook(moe: MoEMLP, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if moe.layer not in self.rows:
                self.rows[moe.layer] = (toks, logits[rows.to(logits.device)])
            return moe.gate.select(logits)

        return hook

    def gather(self, pcp: Comm, num_tokens: int) -> tuple[list[int], torch.Tensor] | None:
        """The step's router logits ``[T, layers, E]`` in the batch's token order, with the
        layers: each rank's rows in place, summed over PCP (one writer row per token, zeros
        elsewhere, so the sum is exactly its row); verification's own traffic, not
        accounted. Clears them."""
        if not self.rows:
            return None
        layers = sorted(self.rows)
        some = self.rows[layers[0]][1]
        dense = some.new_zeros((num_tokens, len(layers), some.shape[1]))
        for k, layer in enumerate(layers):
            toks, logits = self.rows[layer]
            dense[toks.to(dense.device), k] = logits
        self.rows.clear()
        Comm(pcp.group, pcp.rank, pcp.size, None).all_reduce(dense, "verify")
        return layers, dense


class ForcedRouting:
    """The reference's routing for one batch: its own, but the run's at near-ties. ``run``:
    ``(layers, [T, layers, E])`` from ``RecordRouting.gather``; ``atol``: the allowed
    router-logit difference of a near-tie (None: no allowance)."""

    def __init__(self, run: tuple[list[int], torch.Tensor], atol: float | None, batch, report: RoutingReport,
                 keys) -> None:
        layers, self.run_logits = run
        self.index = {layer: k for k, layer in enumerate(layers)}
        self.atol, self.batch, self.report = atol, batch, report
        self.keys = keys  # batch tokens -> their prefix keys (asked only where a near-tie is taken)

    def for_rows(self, tokens: np.ndarray):
        """The hook for the reference's forward (its rows' batch tokens, -1: padding)."""
        keep = np.flatnonzero(tokens >= 0)
        rows, toks = torch.from_numpy(keep), torch.from_numpy(tokens[keep])
        return lambda moe, logits: self._route(moe, logits, rows.to(logits.device), toks)

    def _route(self, moe: MoEMLP, logits: torch.Tensor, rows: torch.Tensor, toks: torch.Tensor):
        weights, ids = moe.gate.select(logits)
        k = self.index.get(moe.layer)
        if k is None or not len(rows):
            return weights, ids
        mine = logits[rows]
        run = self.run_logits[toks.to(self.run_logits.device), k].to(device=logits.device, dtype=logits.dtype)
        diff = (mine - run).abs().amax(dim=-1)
        self.report.max_logit_diff = max(self.report.max_logit_diff, float(diff.max()))
        run_ids, own_ids = moe.gate.select(run)[1], ids[rows]
        differ = (own_ids.sort(dim=-1).values != run_ids.sort(dim=-1).values).any(dim=-1)
        if not bool(differ.any()):
            return weights, ids
        near = differ & (diff <= self.atol) if self.atol is not None else torch.zeros_like(differ)
        self.report.add(self.batch, moe.layer, toks, differ, near, run_ids, own_ids, diff)
        if bool(near.any()):
            ids = ids.clone()
            ids[rows[near]] = run_ids[near]
            weights = moe.gate.select(logits, ids)[0]
            keys = self.keys(toks[near.cpu()].numpy()).tolist()
            self.report.taken.update(zip(((key, moe.layer) for key in keys), run_ids[near].tolist()))
        return weights, ids


class RecalledRouting:
    """The reference's routing where it recomputes positions the run computed before: the
    near-ties taken there (``RoutingReport.taken``, by prefix key and layer), its own
    elsewhere. ``keys``: the prefix key of each token of the batch it computes."""

    def __init__(self, taken: dict[tuple[int, int], list[int]], keys: np.ndarray) -> None:
        self.keys = keys
        self.by_layer: dict[int, dict[int, list[int]]] = {}
        for (key, layer), experts in taken.items():
            self.by_layer.setdefault(layer, {})[key] = experts

    def for_rows(self, tokens: np.ndarray):
        return lambda moe, logits: self._route(moe, logits, tokens)

    def _route(self, moe: MoEMLP, logits: torch.Tensor, tokens: np.ndarray):
        weights, ids = moe.gate.select(logits)
        taken = self.by_layer.get(moe.layer)
        if not taken:
            return weights, ids
        rows = np.flatnonzero(tokens >= 0)
        keys = self.keys[tokens[rows]]
        hit = np.isin(keys, np.fromiter(taken, dtype=np.uint64, count=len(taken)))
        if not hit.any():
            return weights, ids
        ids = ids.clone()
        recalled = [taken[key] for key in keys[hit].tolist()]
        ids[torch.from_numpy(rows[hit]).to(ids.device)] = torch.tensor(recalled, dtype=ids.dtype, device=ids.device)
        return moe.gate.select(logits, ids)[0], ids


class RoutingReport:
    """The routing near-ties and mismatches of a verified run (``result.json``'s ``verify``)."""

    def __init__(self) -> None:
        self.taken: dict[tuple[int, int], list[int]] = {}  # (prefix key, layer) -> the run's experts
        self.max_logit_diff = 0.0
        self.near_ties: list[dict] = []
        self.mismatches: list[dict] = []
        self.num_near_ties = 0
        self.num_mismatches = 0

    def add(self, batch, layer: int, tokens: torch.Tensor, differ: torch.Tensor, near: torch.Tensor,
            run_ids: torch.Tensor, ref_ids: torch.Tensor, diff: torch.Tensor) -> None:
        """Rows (batch ``tokens``) whose experts ``differ`` between the run and the
        reference's own choice (``ref_ids``); the ``near`` ones are near-ties (the reference
        takes the run's)."""
        ties = near.tolist()
        positions = np.asarray(batch.positions)
        for t in differ.nonzero().flatten().tolist():
            token = int(tokens[t])
            tie = ties[t]
            listed = self.near_ties if tie else self.mismatches
            if tie:
                self.num_near_ties += 1
            else:
                self.num_mismatches += 1
            if len(listed) < MAX_LISTED:
                listed.append({
                    "step": int(batch.step), "layer": int(layer),
                    "req_id": int(batch.req_ids[batch.req_indices[token]]), "position": int(positions[token]),
                    "run_experts": sorted(run_ids[t].tolist()),
                    "reference_experts": sorted(ref_ids[t].tolist()),
                    "router_logit_diff": float(diff[t]),
                })

    def summary(self, atol: float) -> dict:
        """``routing_match``: no routing mismatch, and every router logit within ``atol``
        of the reference's (router logits are logits: the run's one tolerance)."""
        return {
            "routing_match": bool(self.num_mismatches == 0 and self.max_logit_diff <= atol),
            "max_abs_router_logit_diff": self.max_logit_diff,
            "num_routing_near_ties": self.num_near_ties,
            "routing_near_ties": self.near_ties,
            "num_routing_mismatches": self.num_mismatches,
            "routing_mismatches": self.mismatches,
        }
