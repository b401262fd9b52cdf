"""A whole HF GPT-2 made tensor-parallel by ``schedules/gpt_tp.py``, against one device."""

import pytest
import torch
import torch.distributed as dist
import transformers

import megatron_slapo as ms
from megatron_slapo import parallel
from megatron_slapo.parallel.collectives import gather_tensor
from megatron_slapo.plans.styles import apply_plan
from schedules import gpt_tp
from tests.distributed.conftest import use_layout
from tests.utils import local_part, max_diff, tiny_gpt2_config

STEPS, SEED = 5, 42


def meta_gpt2(cfg):
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(cfg)


def batches(cfg, n):
    """Two fixed batches, alternating: the loss must fall as the model memorises them."""
    gen = torch.Generator().manual_seed(0)
    pair = [torch.randint(0, cfg.vocab_size, (4, 16), generator=gen) for _ in range(2)]
    return [pair[i % 2] for i in range(n)]


def train(model, data):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses = []
    for ids in data:
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def check_training_parity(group, rank, world):
    cfg = tiny_gpt2_config()
    reference = ms.build(ms.Schedule(meta_gpt2(cfg)), seed=SEED)  # single device, no group
    sch = ms.create_schedule(meta_gpt2(cfg), group)
    gpt_tp.apply(sch, cfg)
    model = ms.build(sch, seed=SEED)
    assert model.transformer.h[0].mlp.c_fc.weight.shape == (32, 128 // world)
    assert model.lm_head.weight is model.transformer.wte.weight

    # Layout-independent init: the shards are slices of the single-device weights.
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), local_part(ref_params[name], p, rank, world).detach()), f"initial {name}"

    data = batches(cfg, STEPS)
    ref_losses, losses = train(reference, data), train(model, data)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < 1e-5, (losses, ref_losses)
    assert ref_losses[-1] < ref_losses[0]


@pytest.mark.world_sizes(2, 4)
def test_gpt2_tp_trains_like_one_device(group, rank, world):
    check_training_parity(group, rank, world)


@pytest.mark.world_sizes(4)
def test_gpt2_tp2_inside_a_4_rank_world_uses_the_tp_group(rank):
    """TP=2 x DP=2: the default schedule group is megatron-core's tensor-parallel group."""
    use_layout(2)
    from megatron.core import parallel_state as ps

    sch = ms.create_schedule(meta_gpt2(tiny_gpt2_config()))
    assert sch.world_size == 2 and sch.group is ps.get_tensor_model_parallel_group()
    check_training_parity(sch.group, ps.get_tensor_model_parallel_rank(), 2)


@pytest.mark.world_sizes(2, 4)
def test_gpt2_tp_from_pretrained_reproduces_logits(group, rank, world, tmp_path_factory):
    cfg = tiny_gpt2_config()
    torch.manual_seed(SEED)
    original = transformers.GPT2LMHeadModel(cfg).eval()
    path = [str(tmp_path_factory.mktemp("gpt2")) if rank == 0 else None]
    if rank == 0:
        original.save_pretrained(path[0])
    dist.broadcast_object_list(path, src=0)

    model = transformers.GPT2LMHeadModel.from_pretrained(path[0]).eval()
    sch = ms.create_schedule(model, group)
    gpt_tp.apply(sch, cfg)
    ms.build(sch)  # pretrained weights are real: build leaves them as they are
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = original(ids, labels=ids)
        out = model(ids, labels=ids)
        logits = gather_tensor(out.logits, -1, group)
    assert max_diff(logits, expected.logits) < 1e-5
    assert abs(out.loss.item() - expected.loss.item()) < 1e-5


def test_verify_passes_gpt_tp_and_catches_a_missing_sync(group):
    cfg = tiny_gpt2_config()
    ids = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(4))
    sch = ms.create_schedule(meta_gpt2(cfg), group)
    with ms.Verify(sch, [ids], {"labels": ids}, seed=SEED) as verify:
        gpt_tp.apply(sch, cfg)
    assert verify.report.grads and not verify.report.failures

    plan = {k: v for k, v in gpt_tp.PLAN.items() if k != "transformer.h.*.mlp.c_proj"}
    plan["transformer.h.*.mlp.c_proj"] = _RowParallelWithoutSync()
    sch = ms.create_schedule(meta_gpt2(cfg), group)
    with pytest.raises(ms.VerificationError, match="differs from the original"):
        with ms.Verify(sch, [ids], {"labels": ids}, seed=SEED):
            apply_plan(sch, plan)


class _RowParallelWithoutSync:
    def apply(self, sch):
        sch.shard("weight", axis=0)


def test_checkpointed_blocks_replay_dropout_under_tp(group, rank, world):
    cfg = tiny_gpt2_config(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(5))
    results = []
    for checkpointed in (False, True):
        sch = ms.create_schedule(meta_gpt2(cfg), group)
        gpt_tp.apply(sch, cfg)
        if checkpointed:
            for i in range(cfg.n_layer):
                sch[f"transformer.h.{i}"].checkpoint()
        model = ms.build(sch, seed=SEED).train()
        parallel.seed(7, tensor_parallel_rank=rank)
        loss = model(ids, labels=ids).loss
        loss.backward()
        results.append([loss, *(p.grad for p in model.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_explain_shows_each_ranks_shards_and_collectives(group, rank):
    """Schedule.explain() at TP2: this rank's half of each split tensor, the collectives, and this
    rank's share of the parameters (the layer norms and position table stay whole on every rank)."""
    cfg = tiny_gpt2_config()  # vocabulary 128, width 32, 2 layers, 4 heads
    sch = ms.create_schedule(transformers.GPT2LMHeadModel(cfg), group)
    gpt_tp.apply(sch, cfg)
    lines = sch.explain().splitlines()
    whole = sum(p.numel() for p in transformers.GPT2LMHeadModel(cfg).parameters())
    local = sum(p.numel() for p in sch.mod.parameters())
    assert lines[0] == (f"GPT2LMHeadModel: tensor-parallel rank {rank} of 2; parameters here {local:,} of "
                        f"{whole:,} ({local / whole:.0%})")  # fmt: skip
    assert local < whole * 0.6
    rows = dict(line.split("  ", 1) for line in lines[1:])
    assert rows["transformer.h.*.attn.c_attn (x2)"].strip() == (
        "column-parallel; shard bias axis 0, stride 3: (96,) -> (48,); shard weight axis 1, stride 3: (32, 96) -> "
        "(32, 48); sync bwd_post all_reduce"
    )
    assert rows["transformer.h.*.mlp.c_proj (x2)"].strip() == (
        "row-parallel; shard weight axis 0: (128, 32) -> (64, 32); sync fwd_post all_reduce"
    )
    assert rows["transformer.wte"].strip().startswith("vocab-parallel; shard weight axis 0: (128, 32) -> (64, 32)")
