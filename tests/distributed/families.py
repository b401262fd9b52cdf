"""Tiny configs of the families ``--schedule auto`` is for, shared by the tests that build or train them."""

import os

import torch.distributed as dist
import transformers
from transformers import CONFIG_MAPPING

# Each a tiny config of the family's defaults: grouped-query attention (2 key/value heads for 4),
# per-head norms (qwen3), packed q|k|v (gpt_neox), biases (starcoder2), 4 experts, top-2.
SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, head_dim=16, pad_token_id=0, bos_token_id=0,
             eos_token_id=0, num_local_experts=4, num_experts=4, n_routed_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=32, n_group=1, topk_group=1)  # fmt: skip
# Families whose defaults need more than SIZES. DeepSeek's multi-head latent attention: a query rank
# (v3) or none (v2: q_proj), small latent ranks and head widths (its head_dim is the rotary part),
# a key/value head per head; v3's grouped top-k (2 groups of 2 experts, 1 group picked, top-2); a
# first dense layer, then shared experts beside the routed ones (dots1's default count is None).
LATENT = dict(num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
              head_dim=8, first_k_dense_replace=1)  # fmt: skip
FAMILY_SIZES = {
    "deepseek_v3": dict(LATENT, q_lora_rank=24, n_group=2, topk_group=1),
    "deepseek_v2": dict(LATENT, q_lora_rank=None),
    "dots1": dict(n_shared_experts=1, first_k_dense_replace=1),
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"]),  # its hybrid layers, one of each
}


def tiny(family: str) -> transformers.PretrainedConfig:
    """The family's config class with its defaults, scaled down (fields it lacks are dropped)."""
    cls = CONFIG_MAPPING[family]
    fields = {k: v for k, v in SIZES.items() if k in cls().to_dict() or k in ("vocab_size", "hidden_size")}
    return cls(**{**fields, **FAMILY_SIZES.get(family, {})})


def saved_configs(root: str, families: list[str]) -> str:
    """``root``, holding each family's :func:`tiny` config as an ``--hf-config`` directory (rank 0 writes)."""
    if dist.get_rank() == 0:
        for family in families:
            tiny(family).save_pretrained(os.path.join(root, family))
    dist.barrier()
    return root
