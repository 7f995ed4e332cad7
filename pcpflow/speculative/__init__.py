"""Speculative decoding: what a draft stage needs to propose tokens under PCP and DCP.

A drafter is a stage in the ``draft`` slot. It runs on every rank after ``restore`` and
sets ``state.draft_token_ids`` ``[R, k]`` (``-1`` = none): per batch row, the tokens it
proposes to follow the request's newest token. The scheduler verifies them next step
(``pcpflow.scheduling.scheduler``). The scheduler is global, so **every rank must propose the same
tokens**: every input to a proposal must be identical on all ranks — a restored
(all-gathered) tensor, or a replicated computation on such inputs.

One drafting step has three parts (``stages/mtp.py`` reads top to bottom as an example). The helpers live by concern:
``drafting`` (what the step decided, proposals, caches, draft layers), ``attention`` (the
draft's attention backends) and ``comm`` (draft traffic accounted apart):

1. **Draft prefill**, on the PCP-local batch, like the target's forward: the draft model
   runs on ``state.local``'s rows (per-token inputs taken from the global batch through
   the layout with ``to_local``, e.g. ``next_token_ids``) with ``prefill_attention``:
   ``CPAttention`` over the target's layout and slot mapping, on the draft's own caches
   (``allocate_caches``), so its KV is gathered over PCP and sharded over DCP exactly like
   the target's. ``restore_hidden`` brings its hidden states back to the global batch.
2. **Where drafting starts**, ``draft_start``: per request that sampled this step, how
   many drafts were accepted, the token whose sample is the newest token, and the newest
   token with its position (greedy verification, ``scheduler.accept_drafts``).
3. **Later draft steps, replicated**: every rank runs every request's next draft rows
   (``replicated_attention``: a layout of decode rows only, KV written by every rank into
   its full cache, or into its DCP shard with partials merged over DCP).

``scatter_proposals`` turns the proposals into ``state.draft_token_ids``. Draft
collectives are accounted as ``draft_<purpose>`` (``draft_kv_gather``, ``draft_restore``).

A drafter lists its caches in ``Stage.own_kv``: ``verify=true`` checks them as the target's
(``pcpflow.rank.verify``), against the single-rank reference's drafter, at the positions
each step committed; past the newest token a drafter may write only its
``num_speculative_tokens`` positions of scratch.
"""
