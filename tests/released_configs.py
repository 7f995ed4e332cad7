"""config.json files of released checkpoints, as their publishers give them on Hugging Face, for
the tests that read them (``model=hf``) and the model cards that copy them (``conf/model/``)."""

from __future__ import annotations


def llama4_config(*, experts: int, step: int, qk_norm: bool, rope_scaling: dict | None, longest: int) -> dict:
    """config.json of meta-llama/Llama-4-Scout-17B-16E(-Instruct) and Llama-4-Maverick-17B-128E(-Instruct)
    as released on Hugging Face (Llama4ForConditionalGeneration; the vision config abridged: pcpflow
    leaves it unread), text_config with the fields they publish."""
    layers = 48
    text = dict(
        model_type="llama4_text", attention_bias=False, attention_chunk_size=8192, attn_scale=0.1,
        attn_temperature_tuning=True, floor_scale=8192, head_dim=128, hidden_act="silu", hidden_size=5120,
        interleave_moe_layer_step=step, intermediate_size=8192, intermediate_size_mlp=16384,
        max_position_embeddings=longest, moe_layers=list(range(step - 1, layers, step)),
        no_rope_layers=[int((i + 1) % 4 != 0) for i in range(layers)], num_attention_heads=40, num_experts_per_tok=1,
        num_hidden_layers=layers, num_key_value_heads=8, num_local_experts=experts, rms_norm_eps=1e-5,
        rope_scaling=rope_scaling, rope_theta=500000.0, use_qk_norm=qk_norm, vocab_size=202048,
        bos_token_id=200000, eos_token_id=[200001, 200007, 200008], pad_token_id=200018, torch_dtype="bfloat16",
    )
    vision = dict(model_type="llama4_vision_model", hidden_size=1408, num_hidden_layers=34, num_attention_heads=16,
                  intermediate_size=5632, image_size=336, patch_size=14, vision_output_dim=4096)
    return dict(architectures=["Llama4ForConditionalGeneration"], model_type="llama4", text_config=text,
                vision_config=vision, boi_token_index=200080, eoi_token_index=200081, image_token_index=200092,
                tie_word_embeddings=False)


SCOUT_ROPE = dict(rope_type="llama3", factor=16.0, low_freq_factor=1.0, high_freq_factor=1.0,
                  original_max_position_embeddings=8192)
"""Llama-4-Scout's text_config rope_scaling."""

LLAMA4_SCOUT = dict(experts=16, step=1, qk_norm=True, rope_scaling=SCOUT_ROPE, longest=10485760)
"""``llama4_config`` options of Llama-4-Scout-17B-16E."""
LLAMA4_MAVERICK = dict(experts=128, step=2, qk_norm=False, rope_scaling=None, longest=1048576)
"""``llama4_config`` options of Llama-4-Maverick-17B-128E."""
