"""Independent references for tests: a dense, cache-free, single-sequence forward of the
tiny models written directly from their weights (MLA not absorbed), and greedy decoding
on top of it. Nothing here uses pcpflow's attention, caches, layouts or scheduler."""

from __future__ import annotations

import math

import torch


def rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def rope(x, positions, theta):
    """Rotate-half rotary embedding of x [N, heads, d], from the definition."""
    d = x.shape[-1]
    freqs = torch.tensor([theta ** (-2.0 * i / d) for i in range(d // 2)], dtype=torch.float64)
    ang = positions.double()[:, None, None] * freqs
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x1 * ang.sin() + x2 * ang.cos()], -1)


def causal_attention(q, k, v, scale, window=None, sinks=None, window_kind="sliding"):
    """q, k [N, H, d], v [N, H, dv] -> [N, H, dv], standard causal softmax attention; with a
    ``window``, query i sees keys i - window < j <= i only, or, ``window_kind="chunked"``,
    keys of its own chunk of ``window`` (i - i % window <= j <= i); ``sinks [H]``: one more
    logit per head in every row's softmax, its probability dropped (gpt-oss's eager attention)."""
    n = q.shape[0]
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    if window is None:
        hidden = j > i
    elif window_kind == "chunked":
        hidden = (j > i) | (j < i - i % window)
    else:
        hidden = (j > i) | (j <= i - window)
    s = s.masked_fill(hidden, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.to(s.dtype)[:, None, None].expand(-1, n, 1)], dim=-1)
    p = torch.softmax(s, -1)[..., :n]
    return torch.einsum("hqk,khd->qhd", p, v)


def dense_attention(spec):
    """The attention backend of one sequence over its own entries, no cache: ``causal_attention`` with
    a model's ``AttentionSpec`` (each KV head shared by its group of query heads)."""

    def attn(layer, q, kv, sinks=None):
        group = spec.num_heads // spec.num_kv_heads
        k, v = (t.repeat_interleave(group, dim=1) for t in (spec.keys(kv), spec.values(kv)))
        return causal_attention(q, k, v, spec.scale)

    return attn


def dense_logits(model, ids):
    """A pcpflow decoder's logits of the one sequence ``ids`` through ``dense_attention``."""
    with torch.no_grad():
        hidden, _ = model(ids, torch.arange(len(ids)), dense_attention(model.attn_spec))
        return model.compute_logits(hidden)


def reference_forward(model, ids):
    """Dense, single-sequence forward written from the weights (MLA not absorbed).
    Returns logits and the residual stream after each layer."""
    c = model.config
    pos = torch.arange(len(ids))
    x = model.embed_tokens.weight[ids]
    residuals = []
    slides = set(c.sliding_layers()) if c.name == "tiny_gqa" else set()
    for index, layer in enumerate(model.layers):
        a = layer.self_attn
        h = rms(x, layer.input_norm.weight, c.rms_norm_eps)
        if c.name == "tiny_mla":
            nope, rdim, vdim, nh = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.num_heads
            if c.q_lora_rank is None:
                q = h @ a.q_proj.weight.T
            else:
                q = (
                    rms(h @ a.q_a_proj.weight.T, a.q_a_norm.weight, c.rms_norm_eps)
                    @ a.q_b_proj.weight.T
                )
            q = q.view(-1, nh, nope + rdim)
            ckv = h @ a.kv_a_proj.weight.T
            latent = rms(ckv[:, : c.kv_lora_rank], a.kv_a_norm.weight, c.rms_norm_eps)
            k_pe = rope(ckv[:, None, c.kv_lora_rank :], pos, c.rope_theta).expand(-1, nh, -1)
            kv = (latent @ a.kv_b_proj.weight.T).view(-1, nh, nope + vdim)
            k = torch.cat([kv[..., :nope], k_pe], -1)
            q = torch.cat([q[..., :nope], rope(q[..., nope:], pos, c.rope_theta)], -1)
            o = causal_attention(q, k, kv[..., nope:], 1 / math.sqrt(nope + rdim))
        else:
            hd, nh, nkv = c.head_dim, c.num_heads, c.num_kv_heads
            q = rope((h @ a.q_proj.weight.T).view(-1, nh, hd), pos, c.rope_theta)
            k = rope((h @ a.k_proj.weight.T).view(-1, nkv, hd), pos, c.rope_theta)
            v = (h @ a.v_proj.weight.T).view(-1, nkv, hd)
            rep = nh // nkv
            o = causal_attention(
                q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), 1 / math.sqrt(hd),
                c.window if index in slides else None, a.sinks, c.window_kind,
            )
        x = x + o.flatten(1) @ a.o_proj.weight.T
        h = rms(x, layer.post_attention_norm.weight, c.rms_norm_eps)
        gate, up = (h @ layer.mlp.gate_up_proj.weight.T).chunk(2, -1)
        x = x + (gate * torch.sigmoid(gate) * up) @ layer.mlp.down_proj.weight.T
        residuals.append(x)
    head = model.embed_tokens.weight if c.tie_word_embeddings else model.lm_head.weight
    return rms(x, model.norm.weight, c.rms_norm_eps) @ head.T, residuals


def greedy_matches(model, prompt: list[int], outputs: list[int]) -> bool:
    """Whether ``outputs`` is the greedy continuation of ``prompt`` under the dense
    reference (teacher-forced: one forward over prompt + outputs[:-1])."""
    ids = torch.tensor(prompt + outputs[:-1], dtype=torch.long)
    logits, _ = reference_forward(model, ids)
    greedy = logits[len(prompt) - 1 :].argmax(-1).tolist()
    return greedy == outputs
