"""What tracing-era rewrites must keep right: decomposed layers' placement, a fused q|k|v projection
under sharding (TP-aware split), and Verify on renamed (fused) weights."""

import copy
import warnings

import pytest
import torch
import transformers
from torch import nn
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

import megatron_slapo as ms
from megatron_slapo.kernels.qkv import FusedQKV
from megatron_slapo.metadata import Role
from megatron_slapo.verify import UncheckedGradientsWarning
from tests.utils import expected_shard, tiny_bert_config, tiny_gpt2_config

H = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))


# ----- decompose: placement kept (10c) ------------------------------------------------------------------
def test_a_decomposed_conv1d_keeps_its_row_parallel_placement():
    """Sharded on its input features, a decomposed HF Conv1D is row-parallel like the Conv1D: its
    bias is added once, after the reduction (it had no placement, so every rank added it)."""
    sch = ms.create_schedule(GPT2MLP(128, tiny_gpt2_config()))
    sch["c_proj"].decompose()
    sch["c_proj"].shard("weight", axis=0)
    assert sch["c_proj"].metadata.role is Role.ROW
    sch["c_fc"].decompose()
    sch["c_fc"].shard("weight", axis=1)
    with pytest.raises(ms.SchedulingError, match=r"\[c_fc\] column-parallel layer: shard its bias too"):
        ms.build(sch)


def _traced_then_decomposed():
    sch = ms.create_schedule(GPT2MLP(128, tiny_gpt2_config()))
    sch.trace(example_inputs=H)
    sch["c_proj"].decompose()  # rewritten as ops in the MLP's graph
    return sch


def _decomposed_then_traced():
    sch = ms.create_schedule(GPT2MLP(128, tiny_gpt2_config()))
    sch["c_proj"].decompose()
    sch.trace(example_inputs=H)  # a decomposed layer is traced through
    return sch


@pytest.mark.parametrize("make", [_traced_then_decomposed, _decomposed_then_traced], ids=["after", "before"])
def test_a_row_parallel_layer_traced_through_is_refused_by_build(make):
    """In the graph its matmul and bias add are separate ops, so no reduction can come between
    them: each rank would add the bias to its partial sum."""
    sch = make()
    sch["c_proj"].shard("weight", axis=0)
    with pytest.raises(ms.SchedulingError, match=r"\[c_proj\] row-parallel layer whose bias add after the "
                                                 r"reduction cannot happen: the traced graph of <root> does not call"):  # fmt: skip
        ms.build(sch)


# ----- FusedQKV under tensor parallelism (10a) ----------------------------------------------------------
def _fused(sizes=(32, 32, 32), head_dim=8):
    torch.manual_seed(0)
    q, k, v = (nn.Linear(32, size) for size in sizes)
    return FusedQKV.from_linears(q, k, v, head_dim=head_dim), (q, k, v)


def _as_rank(fused, rank, world, stride):
    """``fused`` as rank ``rank`` would hold it after shard('weight'/'bias', axis=0, stride=stride)."""
    local = copy.deepcopy(fused)
    for name in ("weight", "bias"):
        full = getattr(fused.proj, name)
        part = nn.Parameter(expected_shard(full.detach(), 0, rank, world, stride))
        part.tensor_model_parallel, part.partition_dim, part.partition_stride = True, 0, stride
        setattr(local.proj, name, part)
    return local


@pytest.mark.parametrize("rank", [0, 1])
def test_a_sharded_fused_qkv_splits_into_this_ranks_heads(rank):
    fused, layers = _fused()
    local = _as_rank(fused, rank, 2, stride=3)
    assert local.schedule_problem() is None and local.split_sizes() == [16, 16, 16]
    for got, layer in zip(local(H), layers, strict=True):  # this rank's heads of q, k and v
        assert torch.allclose(got, expected_shard(layer(H), -1, rank, 2), atol=1e-6, rtol=0)


def test_fused_qkv_layouts_that_split_heads_or_mix_q_k_v_are_refused():
    fused, _ = _fused()
    assert "does not give each rank its own part of q, k and v" in _as_rank(fused, 0, 2, stride=1).schedule_problem()
    gqa, _ = _fused(sizes=(32, 16, 16))  # 4 query heads, 2 key/value heads: no stride layout keeps groups whole
    assert "shard separate q, k, v layers instead" in _as_rank(gqa, 0, 2, stride=4).schedule_problem()
    wide, _ = _fused(head_dim=32)  # one head each: cannot be split over 2 ranks
    assert "not whole heads of 32" in _as_rank(wide, 0, 2, stride=3).schedule_problem()
    with pytest.raises(ValueError, match="FusedQKV: sharding its projection with stride 1"):
        _as_rank(fused, 0, 2, stride=1)(H)


# ----- Verify on renamed weights (10d) ------------------------------------------------------------------
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_verify_compares_fused_weights_with_their_originals(device):
    """The fused projection's gradient is compared with the concatenated q, k, v gradients; on a
    meta model build also initialises it as the concatenation of what q, k, v would have been."""
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.device(device):
        model = transformers.BertForMaskedLM(tiny_bert_config()).eval()
    sch = ms.create_schedule(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncheckedGradientsWarning)
        with ms.Verify(sch, [ids], seed=1) as verify:
            sch.trace(example_inputs={"input_ids": ids})
            for i in range(2):
                attn = sch[f"bert.encoder.layer.{i}.attention.self"]
                fused = FusedQKV.from_linears(attn["query"].mod, attn["key"].mod, attn["value"].mod, head_dim=8)
                attn.replace(fused, target_ops=attn.find(r"^(query|key|value)$"), name="qkv")
    fused_grads = [name for name in verify.report.grads if ".qkv.proj." in name]
    assert len(fused_grads) == 4 and not verify.report.unchecked


class Renamed(nn.Module):
    """``x @ w.T + b``: the same maths as the Linear it replaces, under other parameter names."""

    def __init__(self, linear):
        super().__init__()
        self.w, self.b = nn.Parameter(linear.weight.detach().clone()), nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):
        return nn.functional.linear(x, self.w, self.b)


def test_verify_names_the_gradients_it_cannot_compare():
    sch = ms.create_schedule(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)))
    with pytest.warns(UncheckedGradientsWarning, match=r"did not compare the gradients of: 2.w \(no parameter of "
                                                       r"this name in the original model, and no recorded origin\)"):  # fmt: skip
        with ms.Verify(sch, [torch.randn(3, 8)]) as verify:
            sch["2"].replace(Renamed(sch["2"].mod), keep_weights=False)
    assert sorted(verify.report.unchecked) == ["2.b", "2.w"] and len(verify.report.grads) == 2
