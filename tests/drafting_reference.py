"""Dense, cache-free references of the shipped drafters (MTP, DSpark), written from their
weights with tests/reference.py's building blocks (no pcpflow attention, cache, layout or
scheduler), and the drafting workload the tests share."""

from __future__ import annotations

import math
import tempfile

import torch
from pcpflow.stages.dspark import DSparkDraft, DSparkModel
from pcpflow.stages.mtp import MTPDraft, MTPHead
from pcpflow_test_plugins import draft_probe
from reference import reference_forward, rms, rope

from pcpflow.models import build_model
from pcpflow.models.common import build_seeded
from pcpflow.testing import compose

OUTPUT_LEN = 7
PROMPT_LENS = [1, 5, 8, 13, 33]
PROBE = "pcpflow_test_plugins.draft_probe:DraftProbe"
TOY = "pcpflow_test_plugins.toy_drafter"

# prompts of 1 token, shorter than 2P, a prompt longer than the budget (continued over
# steps: its chunks' successors come from the prompt), staggered arrivals and more
# requests than seats, so prefills, verify rows and idle decodes share batches.
WORKLOAD = [
    "workload=explicit",
    f"workload.prompt_lens=[{','.join(map(str, PROMPT_LENS))}]",
    f"workload.output_lens=[{OUTPUT_LEN}]",
    "workload.arrival_steps=[0,0,1,2,3]",
    "scheduler.max_num_batched_tokens=20",
    "scheduler.max_num_seqs=4",
    "kv.block_size=5",
    "dtype=float64",
    "output.progress=false",
]

DRAFTERS = {
    "self": ["draft=self"],
    "self_err": ["draft=self", "draft.error_rate=0.4"],
    "mtp": ["draft=mtp"],
    "dspark": ["draft=dspark"],
    "toy": [f"plugins=[{TOY}]", "pipeline.draft.kind=toy_repeat"],
}


def mla_attention(attn, c, hq, pos_q, hkv, pos_kv, visible):
    """Standard (not absorbed) MLA of query inputs ``hq`` over key inputs ``hkv``;
    ``visible [nq, nkv]`` says which keys each query sees."""
    nope, rdim, vdim, nh, r = (
        c.qk_nope_head_dim,
        c.qk_rope_head_dim,
        c.v_head_dim,
        c.num_heads,
        c.kv_lora_rank,
    )
    q = (hq @ attn.q_proj.weight.T).view(-1, nh, nope + rdim)
    q = torch.cat([q[..., :nope], rope(q[..., nope:], pos_q, c.rope_theta)], -1)
    ckv = hkv @ attn.kv_a_proj.weight.T
    latent = rms(ckv[:, :r], attn.kv_a_norm.weight, c.rms_norm_eps)
    kv = (latent @ attn.kv_b_proj.weight.T).view(-1, nh, nope + vdim)
    k = torch.cat(
        [kv[..., :nope], rope(ckv[:, None, r:], pos_kv, c.rope_theta).expand(-1, nh, -1)], -1
    )
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(nope + rdim)
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
    return torch.einsum("hqk,khd->qhd", probs, kv[..., nope:]).flatten(1) @ attn.o_proj.weight.T


def decoder_layer(layer, c, x, pos, visible, ctx_h=None, ctx_pos=None):
    """Pre-norm block; keys are ``[ctx_h (context inputs) | x]`` when ``ctx_h`` is given."""
    h = rms(x, layer.input_norm.weight, c.rms_norm_eps)
    hkv, pkv = h, pos
    if ctx_h is not None:
        hkv = torch.cat([rms(ctx_h, layer.input_norm.weight, c.rms_norm_eps), h])
        pkv = torch.cat([ctx_pos, pos])
    x = x + mla_attention(layer.self_attn, c, h, pos, hkv, pkv, visible)
    gate, up = (
        rms(x, layer.post_attention_norm.weight, c.rms_norm_eps) @ layer.mlp.gate_up_proj.weight.T
    ).chunk(2, -1)
    return x + (gate * torch.sigmoid(gate) * up) @ layer.mlp.down_proj.weight.T


def greedy_token(target, hidden_normed) -> int:
    return int((hidden_normed @ target.lm_head.weight.T).argmax())


def mtp_reference(target, head, c, seq, p, k):
    """The k MTP drafts after ``seq[p]`` (the newest token, at position p)."""
    _, residuals = reference_forward(target, torch.tensor(seq[:p]))
    h = rms(residuals[-1], target.norm.weight, target.config.rms_norm_eps)
    emb, eps = target.embed_tokens.weight, c.rms_norm_eps

    def mtp_input(tokens, hidden):
        return (
            torch.cat(
                [rms(emb[tokens], head.enorm.weight, eps), rms(hidden, head.hnorm.weight, eps)], -1
            )
            @ head.eh_proj.weight.T
        )

    x = mtp_input(torch.tensor(seq[1 : p + 1]), h)  # row i: the target at i, the token at i + 1
    drafts = []
    for _ in range(k):
        n = x.shape[0]
        y = decoder_layer(
            head.layer, c, x, torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril()
        )
        drafts.append(greedy_token(target, rms(y[-1], head.norm.weight, eps)))
        x = torch.cat([x, mtp_input(torch.tensor([drafts[-1]]), y[-1:])])
    return drafts


def dspark_reference(target, drafter, c, layers, seq, p, k):
    """The block of k DSpark drafts after ``seq[p]``: context = fused target layers at
    positions < p; block = [seq[p], mask x (k-1)] at p..p+k-1, bidirectional."""
    _, residuals = reference_forward(target, torch.tensor(seq[:p]))
    fused = rms(
        torch.cat([residuals[i] for i in layers], -1) @ drafter.fc.weight.T,
        drafter.fc_norm.weight,
        c.rms_norm_eps,
    )
    x = torch.cat(
        [target.embed_tokens.weight[seq[p]][None], drafter.mask_embed.weight.expand(k - 1, -1)]
    )
    pos = p + torch.arange(k)
    visible = torch.ones(k, p + k, dtype=torch.bool)
    for layer in drafter.layers:
        x = decoder_layer(layer, c, x, pos, visible, ctx_h=fused, ctx_pos=torch.arange(p))
    hidden = rms(x, drafter.norm.weight, c.rms_norm_eps)
    return [greedy_token(target, row) for row in hidden]


def recorded_proposals(ranks):
    """(req_id, newest position, drafts) of every drafting row rank 0 recorded."""
    for _, req_ids, drafts, positions in ranks[0]:
        for rid, row, pos in zip(req_ids, drafts, positions):
            if pos >= 0:
                yield rid, pos, row


def drafter_weights(name, cfg, target):
    """The drafter a run built (its stage Config, its weights, the target layers it reads)."""
    stage_cfg = (MTPDraft if name == "mtp" else DSparkDraft).Config.model_validate(
        cfg.draft_stage_config()
    )
    seed, d, n = cfg.seed + stage_cfg.seed_offset, target.hidden_size, target.num_layers
    if name == "mtp":
        return (
            stage_cfg,
            build_seeded(lambda: MTPHead(d, stage_cfg.layer), seed=seed, dtype=torch.float64),
            None,
        )
    layers = sorted({i % n for i in (stage_cfg.target_layers or [0, n // 2, n - 1])})
    model = build_seeded(
        lambda: DSparkModel(d, len(layers), stage_cfg.num_layers, stage_cfg.layer),
        seed=seed,
        dtype=torch.float64,
    )
    return stage_cfg, model, layers


def assert_proposals_match_the_dense_forward(name, cfg, res, ranks, min_checked=20):
    """Every recorded proposal of drafter ``name`` (mtp | dspark) is what a dense,
    cache-free forward of its weights proposes (stages/ tests call this at one rank)."""
    target = build_model(cfg.model, dtype=torch.float64, seed=cfg.seed)
    stage_cfg, drafter, layers = drafter_weights(name, cfg, target)
    seqs = {
        r["req_id"]: r["prompt_token_ids"] + out for r, out in zip(res["requests"], res["outputs"])
    }
    k, checked = stage_cfg.num_speculative_tokens, 0
    with torch.no_grad():
        for rid, pos, drafts in recorded_proposals(ranks):
            if name == "mtp":
                want = mtp_reference(target, drafter, stage_cfg.layer, seqs[rid], pos, k)
            else:
                want = dspark_reference(target, drafter, stage_cfg.layer, layers, seqs[rid], pos, k)
            assert drafts == want, f"{name} req {rid} at {pos}: {drafts} != dense {want}"
            checked += 1
    assert checked >= min_checked, checked


def one_rank_drafting(name: str):
    """The pcp=1 run of drafter ``name`` on this file's workload, with its proposals
    recorded (in-process: no ranks to start)."""
    from pcpflow.testing import run

    probe = tempfile.mkdtemp(prefix=f"pcpflow-{name}-")
    extra = [f"+pipeline.extra=[{{kind: '{PROBE}', after: draft, path: '{probe}'}}]"]
    cfg = compose(WORKLOAD + ["pcp=1"] + DRAFTERS[name] + extra)
    (res,) = run([cfg])
    return cfg, res, draft_probe.read(probe)
