"""FLOPs per token for TFLOP/s and MFU: counted from the model as it runs (FlopCounterMode on meta)."""

import transformers

from megatron_slapo.training.flops import flops_per_token

S = 128


def test_gpt_matches_megatrons_formula():
    """Megatron: 72 b s L h^2 (1 + s/6h + V/12hL) per step, here per token (b s = 1 x s), for a GPT
    whose FFN is 4h; the count adds what the formula leaves out (biases, norms, the softmax)."""
    L, h, V = 4, 256, 8192
    config = transformers.GPT2Config(n_layer=L, n_embd=h, n_head=8, vocab_size=V, n_positions=S)
    megatron = 72 * L * h**2 * (1 + S / (6 * h) + V / (12 * h * L))
    counted = flops_per_token(transformers.AutoModelForCausalLM, config, S)
    assert megatron <= counted <= 1.01 * megatron, (counted, megatron)


def test_a_layer_shared_across_depth_counts_once_per_use():
    """ALBERT runs one layer L times: each extra depth costs the same, at least 6 FLOPs per token
    for each of the layer's parameters (which a parameter count would see only once)."""

    def count(layers: int) -> tuple[float, int]:
        config = transformers.AlbertConfig(num_hidden_layers=layers, hidden_size=256, embedding_size=128,
                                           num_attention_heads=8, intermediate_size=1024, vocab_size=8192,
                                           max_position_embeddings=S)  # fmt: skip
        model = transformers.AlbertForPreTraining(config)
        shared = sum(p.numel() for p in model.albert.encoder.albert_layer_groups.parameters())
        return flops_per_token(transformers.AutoModelForPreTraining, config, S), shared

    (one, shared), (two, _), (four, _) = count(1), count(2), count(4)
    assert abs((four - two) - 2 * (two - one)) < 1e-6 * four
    assert two - one > 6 * shared


def test_moe_experts_count_once_per_token_and_chosen_expert():
    """HF's MoE experts run as grouped GEMMs; each extra expert per token adds its 3 projections
    (gate, up: h x f; down: f x h) for every token, forward and backward: 3 x 2 x 3 h f per layer."""
    L, h, f = 2, 64, 32

    def count(top_k: int) -> float:
        config = transformers.Qwen3MoeConfig(num_hidden_layers=L, hidden_size=h, moe_intermediate_size=f,
                                             num_experts=8, num_experts_per_tok=top_k, num_attention_heads=4,
                                             num_key_value_heads=2, head_dim=16, vocab_size=256)  # fmt: skip
        return flops_per_token(transformers.AutoModelForCausalLM, config, S)

    assert abs((count(3) - count(2)) - 3 * 2 * 3 * h * f * L) < 1e-6 * count(3)


def test_t5_counts_both_stacks_per_encoder_token():
    """An encoder-decoder per encoder token: its encoder over ``S`` tokens, its decoder over ``D``
    (self-attention, cross-attention whose k and v project the ``S`` encoder states, FFN, LM head).
    The count is exactly these multiply-adds (norms and activations are no matrix products)."""
    h, f, V, L = 128, 512, 4096, 2
    config = transformers.T5Config(vocab_size=V, d_model=h, d_kv=16, d_ff=f, num_layers=L, num_heads=8)
    for D in (S // 4, S // 2):
        encoder = S * L * (4 * h * h + 2 * h * f + 2 * S * h)  # q k v o, FFN, scores and their weighted sum
        decoder = D * L * (6 * h * h + 2 * h * f + 2 * D * h + 2 * S * h) + S * L * 2 * h * h + D * h * V
        expected = 3 * 2 * (encoder + decoder) / S  # forward + backward (twice), 2 FLOPs per multiply-add
        assert flops_per_token(transformers.AutoModelForSeq2SeqLM, config, S, D) == expected
