"""Verifying a mixture-of-experts run: the reference routes as the run did at near-ties.

A router picks each row's top-k experts from its logits. Where two experts' scores nearly
tie, the rounding of a TP sum or a DCP merge (bf16) can make the run pick another expert than
the single-rank reference, and that row's output then differs by far more than the
tolerance: one near-tie would fail the whole run, and every layer after it would drift. The
verifier treats it as it treats a near-tie between two tokens:

- every rank records its own rows' router logits of every MoE layer (``RecordRouting``, the
  forward's ``RoutingHook``); after the step they are gathered over PCP and put in the
  batch's token order (``gather_router_logits``), like the hidden states the run restores;
- the reference routes each row from its own logits (``ForcedRouting``); where the run chose
  other experts, it takes the run's choice (its weights from the reference's own logits) if
  the row's router logits agree within the tolerance (then the run's choice is the router's
  on logits within rounding of the reference's): a *routing near-tie*, listed. Otherwise it
  keeps its own choice and the row is a routing mismatch (verification fails). float64 has
  no allowance, as for tokens.

Router logits are logits: they are held to the run's logit tolerance (``logits_atol``).
Positions the reference recomputes (a prefix hit, a readmission) route as the reference
does: the run computed them in an earlier step.
"""

from __future__ import annotations

import numpy as np
import torch

from pcpflow.models.moe import MoEMLP
from pcpflow.parallel.comm import Comm

MAX_LISTED = 20


def has_experts(model: torch.nn.Module) -> bool:
    return any(isinstance(m, MoEMLP) for m in model.modules())


class RecordRouting:
    """The run's hook: routes as the router does, and keeps this rank's rows' router logits
    per MoE layer (the step's first forward of a layer: the target's)."""

    def __init__(self) -> None:
        self.logits: dict[int, torch.Tensor] = {}

    def __call__(self, moe: MoEMLP, logits: torch.Tensor, own: slice) -> tuple[torch.Tensor, torch.Tensor]:
        self.logits.setdefault(moe.layer, logits[own])
        return moe.gate.select(logits)

    def gather(self, pcp: Comm, restore_idx: np.ndarray) -> tuple[list[int], torch.Tensor] | None:
        """The step's router logits of every PCP rank, ``[T, layers, E]`` in the batch's
        token order (``restore_idx``: the layout's ``hidden_restore_idx``), with the layers;
        a collective over ``pcp`` (verification's own traffic, not accounted). Clears them."""
        if not self.logits:
            return None
        layers = sorted(self.logits)
        mine = torch.stack([self.logits[i] for i in layers], dim=1)
        self.logits.clear()
        quiet = Comm(pcp.group, pcp.rank, pcp.size, None)
        every = quiet.all_gather(mine, "verify")
        return layers, every[torch.from_numpy(restore_idx).to(every.device)]


class ForcedRouting:
    """The reference's hook for one batch: its own routing, but the run's at near-ties.
    ``run``: ``(layers, [T, layers, E])`` from ``RecordRouting.gather``; ``atol``: the
    allowed router-logit difference of a near-tie (None: no allowance)."""

    def __init__(self, run: tuple[list[int], torch.Tensor], atol: float | None, batch, report: RoutingReport) -> None:
        layers, self.run_logits = run
        self.index = {layer: k for k, layer in enumerate(layers)}
        self.atol, self.batch, self.report = atol, batch, report

    def __call__(self, moe: MoEMLP, logits: torch.Tensor, own: slice) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = moe.gate.select(logits)
        k = self.index.get(moe.layer)
        if k is None:
            return weights, ids
        run = self.run_logits[:, k].to(device=logits.device, dtype=logits.dtype)
        n = len(run)  # NOTE: rows past the batch's tokens are the reference's padding
        diff = (logits[:n] - run).abs().amax(dim=-1)
        self.report.max_logit_diff = max(self.report.max_logit_diff, float(diff.max()) if n else 0.0)
        run_ids = moe.gate.select(run)[1]
        differ = (ids[:n].sort(dim=-1).values != run_ids.sort(dim=-1).values).any(dim=-1)
        if not bool(differ.any()):
            return weights, ids
        near = differ & (diff <= self.atol) if self.atol is not None else torch.zeros_like(differ)
        self.report.add(self.batch, moe.layer, differ, near, run_ids, ids[:n], diff)
        if bool(near.any()):
            ids = ids.clone()
            ids[:n][near] = run_ids[near]
            weights = moe.gate.select(logits, ids)[0]
        return weights, ids


class RoutingReport:
    """The routing near-ties and mismatches of a verified run (``result.json``'s ``verify``)."""

    def __init__(self) -> None:
        self.max_logit_diff = 0.0
        self.near_ties: list[dict] = []
        self.mismatches: list[dict] = []
        self.num_near_ties = 0
        self.num_mismatches = 0

    def add(self, batch, layer: int, differ: torch.Tensor, near: torch.Tensor, run_ids: torch.Tensor,
            ref_ids: torch.Tensor, diff: torch.Tensor) -> None:
        """Rows whose experts ``differ`` between the run and the reference's own choice
        (``ref_ids``); the ``near`` ones are near-ties (the reference takes the run's)."""
        rows = differ.nonzero().flatten().tolist()
        ties = near.tolist()
        positions = np.asarray(batch.positions)
        for t in rows:
            tie = ties[t]
            listed = self.near_ties if tie else self.mismatches
            if tie:
                self.num_near_ties += 1
            else:
                self.num_mismatches += 1
            if len(listed) < MAX_LISTED:
                listed.append({
                    "step": int(batch.step), "layer": int(layer),
                    "req_id": int(batch.req_ids[batch.req_indices[t]]), "position": int(positions[t]),
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
