"""Attention-probability dropout under tensor parallelism, and selective recompute of the core.

What can be compared exactly: a one-process model draws one mask per head from one stream; under
TP2 each rank's heads draw theirs from that rank's model-parallel stream (``seed + 2718 + rank``),
as in Megatron, so a TP2 run with dropout has no bit-equal one-process twin. These tests pin down
what holds instead: the ranks' attention masks differ (they would be copies without the fork)
while the masks on replicated activations agree, and recomputing the core replays its masks, so
outputs and gradients with selective recompute equal those without, bit for bit.
"""

import argparse

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers

import megatron_slapo as ms
from megatron_slapo.plans.sequence import split_layers
from megatron_slapo.plans.styles import HeadParallelDropout, apply_plan
from schedules import gpt_tp
from tests.distributed.conftest import use_layout
from tests.utils import tiny_gpt2_config


def _model(group, plan: dict, core_checkpoint: bool = False, implementation: str = "eager") -> torch.nn.Module:
    """Tiny GPT-2 under TP2; "eager" attention makes its dropout a visible F.dropout call."""
    torch.manual_seed(0)
    config = tiny_gpt2_config(attn_pdrop=0.5, resid_pdrop=0.3, embd_pdrop=0.0)
    config._attn_implementation = implementation
    model = transformers.GPT2LMHeadModel(config).train()
    sch = ms.create_schedule(model, group)
    apply_plan(sch, plan)
    if core_checkpoint:
        for i in range(config.n_layer):
            sch[f"transformer.h.{i}.attn"].attention_core(checkpoint=True)
    return ms.build(sch)


def _dropout_masks(model, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The masks of the forward's first attention-probability dropout and first residual dropout."""
    masks: dict[int, list[torch.Tensor]] = {3: [], 4: []}
    dropout = F.dropout

    def recording(x, p=0.5, training=True, inplace=False):
        out = dropout(x, p, training, inplace)
        if p > 0:  # not the embedding's dropout of p=0
            masks[x.dim()].append(out == 0)
        return out

    monkeypatch.setattr(F, "dropout", recording)
    use_layout(2)  # reseeds: every rank's default stream alike, its model-parallel stream its own
    ids = torch.arange(24).reshape(2, 12)
    model(ids, labels=ids)
    return masks[4][0], masks[3][0]


def _gathered(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def test_each_ranks_heads_draw_their_own_masks(group, monkeypatch):
    attention, residual = _dropout_masks(_model(group, gpt_tp.PLAN), monkeypatch)
    attentions, residuals = _gathered(attention.byte()), _gathered(residual.byte())
    assert not torch.equal(attentions[0], attentions[1])  # the ranks' heads: masks of their own
    assert torch.equal(residuals[0], residuals[1])  # replicated activations: one mask

    without_fork = {k: v for k, v in gpt_tp.PLAN.items() if k != "transformer.h.*.attn"}
    without_fork["transformer.h.*.attn"] = gpt_tp.PLAN["transformer.h.*.attn"][0]  # LocalHeads only
    attention, _ = _dropout_masks(_model(group, without_fork), monkeypatch)
    attentions = _gathered(attention.byte())
    assert torch.equal(attentions[0], attentions[1])  # what the fork is for: copies otherwise


def _assert_same_loss_and_grads(plain: torch.nn.Module, recomputing: torch.nn.Module) -> None:
    """One training step of each from the same RNG state: bit for bit the same loss and gradients."""
    results = []
    for model in (plain, recomputing):
        use_layout(2)
        ids = torch.arange(24).reshape(2, 12)
        loss = model(ids, labels=ids).loss
        loss.backward()
        results.append([loss.detach(), *(p.grad for p in model.parameters())])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_recomputing_the_core_replays_its_dropout(group, implementation):
    _assert_same_loss_and_grads(*(_model(group, gpt_tp.PLAN, core_checkpoint=recompute, implementation=implementation)
                                  for recompute in (False, True)))  # fmt: skip


def test_attention_core_needs_a_module_that_calls_the_attention_function(group):
    model = transformers.GPT2LMHeadModel(tiny_gpt2_config())
    sch = ms.create_schedule(model, group)
    with pytest.raises(ms.SchedulingError, match=r"\[transformer.h.0\] GPT2Block has no attention core"):
        sch["transformer.h.0"].attention_core(fork_rng=True)
    sch["transformer.h.0.attn"].attention_core(fork_rng=True)
    with pytest.raises(ms.SchedulingError, match=r"attention_core\(fork_rng=True\) is already applied"):
        HeadParallelDropout().apply(sch["transformer.h.0.attn"])
    sch["transformer.h.0.attn"].attention_core(checkpoint=True)  # the other one may follow
    assert model.config._attn_implementation != model.transformer.h[0].attn.config._attn_implementation


def _sequence_parallel_model(group, recompute: str | None) -> torch.nn.Module:
    torch.manual_seed(0)
    config = tiny_gpt2_config(attn_pdrop=0.5, resid_pdrop=0.3, embd_pdrop=0.0, use_cache=False)  # recompute
    config._attn_implementation = "eager"
    model = transformers.GPT2LMHeadModel(config).train()
    sch = ms.create_schedule(model, group)
    gpt_tp.apply(sch, config, argparse.Namespace(sequence_parallel=True))
    layers = [f"transformer.h.{i}" for i in range(config.n_layer)]
    split_layers(sch, layers)
    for layer in layers if recompute else []:
        if recompute == "full":
            sch[layer].checkpoint()
        else:  # the attention block, whose core forks inside the forked layer while recomputed
            sch[f"{layer}.attn"].checkpoint()
    return ms.build(sch)


@pytest.mark.parametrize("granularity", ["full", "attention"])
def test_sequence_parallel_layers_draw_their_own_masks_and_replay_them(group, monkeypatch, granularity):
    """Under --sequence-parallel the residual dropout acts on this rank's part of the sequence: its
    mask must be its own (one mask repeated on every part otherwise). The layers run on the
    model-parallel stream, their attention cores too (a fork inside a fork), and recomputing the
    layers replays every mask: outputs and gradients equal those without recompute, bit for bit."""
    _, residual = _dropout_masks(_sequence_parallel_model(group, recompute=None), monkeypatch)
    residuals = _gathered(residual.byte())
    assert residual.shape[1] == 6 and not torch.equal(residuals[0], residuals[1])
    _assert_same_loss_and_grads(_sequence_parallel_model(group, None), _sequence_parallel_model(group, granularity))
