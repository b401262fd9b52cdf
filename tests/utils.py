"""Tiny model configs and independent oracles shared by the tests."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers


@functools.cache
def _compiler_problem() -> str | None:
    from megatron_slapo.kernels.compiled import compiler_problem

    return compiler_problem()


def require_compiler() -> None:
    """Skip, with the product's own reason, where torch.compile cannot build kernels (inductor on a
    CPU without a C++ compiler): the product refuses ``--compile`` there with that one line."""
    problem = _compiler_problem()
    if problem:
        pytest.skip(problem)


NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def tiny_gpt2_config(**overrides) -> transformers.GPT2Config:
    kw = dict(vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2Config(**{**kw, **NO_DROPOUT, **overrides})


def tiny_bert_config(**overrides) -> transformers.BertConfig:
    kw = dict(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertConfig(**{**kw, **overrides})


def tiny_llama_config(**overrides) -> transformers.LlamaConfig:
    kw = dict(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return transformers.LlamaConfig(**{**kw, **overrides})


def tiny_albert() -> transformers.AlbertForPreTraining:
    """One layer shared by two depths, a factorised embedding."""
    return transformers.AlbertForPreTraining(transformers.AlbertConfig(
        vocab_size=128, embedding_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))  # fmt: skip


def tiny_roberta() -> transformers.RobertaForMaskedLM:
    """Masked LM only; positions offset by the padding id."""
    return transformers.RobertaForMaskedLM(transformers.RobertaConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=66, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=1))  # fmt: skip


def tiny_t5(gated: bool) -> transformers.T5ForConditionalGeneration:
    """T5 v1.0 (ReLU FFN, tied head) or v1.1 (gated-GeLU FFN, untied head), two layers a stack."""
    config = transformers.T5Config(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
        feed_forward_proj="gated-gelu" if gated else "relu", tie_word_embeddings=not gated, decoder_start_token_id=0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def tiny_wideresnet():
    """Two stages: a projection shortcut in each first block, an identity one in the second."""
    from megatron_slapo.models.wideresnet import WideResNetConfig, WideResNetForImageClassification

    config = WideResNetConfig(layers=(2, 1), base_channels=8, width_per_group=32, small_images=True, num_labels=6)
    return WideResNetForImageClassification(config)


def expected_shard(
    full: torch.Tensor, axis: int, rank: int, world: int, stride: int | tuple[int, ...] = 1
) -> torch.Tensor:
    """Rank ``rank``'s slice of ``full``, written out independently of the library's layout code:
    ``stride`` s equal blocks, or a tuple of the blocks' relative sizes."""
    weights = (1,) * stride if isinstance(stride, int) else tuple(stride)
    unit = full.size(axis) // sum(weights)
    blocks = full.split([w * unit for w in weights], dim=axis)
    return torch.cat([b.chunk(world, dim=axis)[rank] for b in blocks], dim=axis)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    return (a.detach().float() - b.detach().float()).abs().max().item()


def local_part(full: torch.Tensor, param: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """What a (possibly sharded) parameter should hold locally, given the unsharded tensor."""
    if getattr(param, "tensor_model_parallel", False):
        return expected_shard(full, param.partition_dim, rank, world, param.partition_stride)
    return full


def assert_grads_match(model, reference, rank: int, world: int, tol: float = 1e-5) -> None:
    """Every local gradient equals the matching slice of the unsharded model's gradient."""
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert max_diff(p.grad, local_part(ref_params[name].grad, p, rank, world)) < tol, name


def tb_scalars(logdir: str, tag: str) -> dict[int, float]:
    """``{step: value}`` of one scalar tag in the TensorBoard event files under ``logdir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir, size_guidance={"scalars": 0})
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


def tb_tags(logdir: str) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir)
    acc.Reload()
    return acc.Tags()["scalars"]
