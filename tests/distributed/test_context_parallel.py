"""--context-parallel-size: every layer on a part of each sequence, attention's keys and values
passed round a ring (or all gathered). The kernel against SDPA on the whole sequence; 10 fp32 steps
against one process at every layout it composes with (the README's suite: llama_tp at CP2; the slow
tier: the rest); the ring's bytes against the analytic count; activations per rank against one
process's; a context-parallel checkpoint resumed in one process."""

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers

import megatron_slapo as ms
from megatron_slapo.errors import SchedulingError
from megatron_slapo.kernels import ring_attention
from megatron_slapo.kernels.ring_attention import context_attention
from megatron_slapo.parallel.comm_log import CommLog
from megatron_slapo.parallel.context import ContextParallel
from megatron_slapo.plans.context_parallel import split_attention
from megatron_slapo.training.loop import pretrain
from schedules import auto
from tests.distributed.families import tiny
from tests.distributed.runs import (
    PARITY,
    asked,
    assert_grad_norm_parity,
    assert_parity,
    layout_case,
    reference_losses,
    refused_on_every_rank,
    single_process_losses,
    train_losses,
)

CP2, CP4 = ["--context-parallel-size", "2"], ["--context-parallel-size", "4"]
TP2, PP2, SP = ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"], ["--sequence-parallel"]
MODELS = {
    "llama": ["--schedule", "llama_tp", "--model-type", "llama", "--num-query-groups", "2"],
    "gpt": ["--schedule", "gpt_tp"],  # learned positions
    "opt": ["--schedule", "opt_tp", "--model-type", "opt"],
    "gpt_neo": ["--schedule", "gpt_neo_tp", "--model-type", "gpt_neo"],
    "qwen3_moe": ["--schedule", "auto", "--model-type", "qwen3_moe", "--num-query-groups", "2", "--num-experts", "4",
                  "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--lr", "1e-2", "--min-lr", "1e-3"],
}  # fmt: skip
# (model, layout, world sizes, flags): the slow tier, but for DEFAULT
LAYOUTS = [
    ("llama", "cp2", (2,), CP2),
    ("llama", "cp2-allgather-distopt", (2,), [*CP2, "--cp-comm-type", "allgather", "--use-distributed-optimizer"]),
    ("llama", "cp2-ddp", (2,), [*CP2, "--engine", "ddp"]),
    ("llama", "cp2-fsdp", (2,), [*CP2, "--engine", "fsdp"]),
    ("llama", "cp2-selective-recompute", (2,), [*CP2, "--recompute-granularity", "selective"]),
    ("llama", "cp2-full-recompute", (2,), [*CP2, "--recompute-granularity", "full", "--recompute-method", "uniform"]),
    ("llama", "cp2-tp2-sp", (4,), [*CP2, *TP2, *SP]),
    ("llama", "cp2-pp2", (4,), [*CP2, *PP2]),
    ("llama", "cp4", (4,), CP4),
    # two data-parallel ranks of two context-parallel ones: each pair reads its micro-batches
    ("llama", "cp2-dp2-distopt", (4,), [*CP2, "--micro-batch-size", "2", "--use-distributed-optimizer"]),
    ("qwen3_moe", "cp2-ep2", (4,), [*CP2, "--expert-model-parallel-size", "2"]),
    ("gpt", "cp2", (2,), CP2),
    ("opt", "cp2", (2,), CP2),
    ("gpt_neo", "cp2", (2,), CP2),
    ("qwen3_moe", "cp2", (2,), CP2),
]
# The README's suite's trainer check: the ring, the loss summed over the CP ranks (its value and its
# gradient's factor) and the gradients averaged over the DP x CP ranks, step by step against one process
DEFAULT = {"llama-cp2"}


def _argv(model: str, cache: str) -> list[str]:
    return [*PARITY, *MODELS[model], "--data-cache-path", cache]


@pytest.fixture(scope="module")
def reference(shared_tmp, cache, request):
    """One process's runs of the models this session trains, run in one process."""
    return reference_losses(shared_tmp, lambda model: ("gpt", _argv(model, cache)), asked(request, "model"))


def _case(model: str, name: str, sizes: tuple, flags: list[str]) -> pytest.param:
    return layout_case(model, name, sizes, flags, slow=f"{model}-{name}" not in DEFAULT)


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("comm", ["p2p", "allgather"])
@pytest.mark.parametrize("window", [None, 5])
def test_each_rank_attends_as_sdpa_over_the_whole_sequence(comm, window, monkeypatch):
    """Every rank's outputs and gradients for its tokens equal SDPA's on the whole sequence (causal,
    grouped-query heads, values narrower than keys, a sliding window)."""
    monkeypatch.setattr(ring_attention, "TILE_ROWS", 3)  # queries a few at a time
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 32, d, dtype=torch.float64, generator=generator) for h, d in ((4, 8), (2, 8), (2, 6)))
    grad = torch.randn(2, 4, 32, 6, dtype=torch.float64, generator=generator)
    gap = torch.arange(32)[:, None] - torch.arange(32)[None, :]
    allowed = (gap >= 0) & (gap < (window or 32))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*whole, attn_mask=allowed, scale=0.25, enable_gqa=True)
    expected_grads = torch.autograd.grad(expected, whole, grad)
    cp = ContextParallel(dist.group.WORLD, dist.get_rank(), dist.get_world_size(), comm)
    mine = [cp.local(t, dim=2).requires_grad_() for t in (q, k, v)]
    out = context_attention(*mine, cp, scale=0.25, window=window)
    grads = torch.autograd.grad(out, mine, cp.local(grad, dim=2))
    assert (out - cp.local(expected, dim=2)).abs().max() < 1e-12
    for got, want in zip(grads, expected_grads, strict=True):
        assert (got - cp.local(want, dim=2)).abs().max() < 1e-12


@pytest.mark.parametrize("model, flags", [_case(*layout) for layout in LAYOUTS])
def test_context_parallel_trains_as_one_process(model, flags, reference, shared_tmp, cache, request):
    """Each step's loss within 1e-5 of one process's, and its gradient norm within 1e-4 (relative;
    fp32 reduction order moves it by ~3e-5): a loss summed over the wrong ranks moves the losses;
    gradients reduced over the wrong ranks, or with a wrong factor (which Adam's update can hide
    from the losses), move the gradient norm."""
    tb = os.path.join(shared_tmp, f"tb-cp-{request.node.callspec.id}")
    assert_parity(train_losses("gpt", [*_argv(model, cache), *flags], tb), reference(model), 1e-5)
    assert_grad_norm_parity(tb, reference(model, "grad-norm"), 1e-4)


@pytest.mark.slow
def test_attention_dropout_trains_at_cp2(shared_tmp, cache):
    """GPT-2 with its attention and hidden dropout on: the ring draws the probabilities' masks (and
    draws them again in the backward); the run completes and learns."""
    argv = [*_argv("gpt", cache), "--attention-dropout", "0.1", "--hidden-dropout", "0.1", *CP2]
    losses = train_losses("gpt", argv, os.path.join(shared_tmp, "tb-cp-dropout"))
    assert sorted(losses) == list(range(1, 11)) and losses[10] < losses[1] - 0.1, losses


def _ring_bytes(comm: str, layers: int, micro: int, batch: int, seq: int, cp: int, kv_heads: int, dim: int) -> dict:
    """What each rank sends and receives a step (fp32): per layer and micro-batch, a key/value block
    of ``2 x batch x kv_heads x seq/cp x dim`` and its gradient (fp32 too)."""
    block = 2 * batch * kv_heads * (seq // cp) * dim * 4
    loss = {"all_reduce[cp]": 8 * micro}  # the loss's sum and token count
    if comm == "allgather":  # forward gather, backward gather again and reduce-scatter of the gradients
        per = {"all_gather_single[cp]": 2 * cp * block, "reduce_scatter_single[cp]": cp * block}
    else:  # forward: cp-1 hops; backward: cp-1 hops of the block, cp of its gradient
        per = {"isend[cp]": (2 * (cp - 1) + cp) * block, "irecv[cp]": (2 * (cp - 1) + cp) * block}
    return {**{k: v * layers * micro for k, v in per.items()}, **loss}


@pytest.mark.parametrize("comm", ["p2p", "allgather"])
def test_ring_bytes_per_step_equal_the_analytic_count(comm, shared_tmp, cache, monkeypatch):
    counts = []
    take = CommLog.take
    monkeypatch.setattr(CommLog, "take", lambda self: counts.append(take(self)) or counts[-1])
    argv = [*_argv("llama", cache), "--train-iters", "2", *CP2, "--cp-comm-type", comm, "--log-comm"]
    pretrain("gpt", [*argv, "--tensorboard-dir", os.path.join(shared_tmp, f"tb-cp-comm-{comm}")])
    steps = [{k: v for k, v in step.items() if k.endswith("[cp]")} for step in counts[1::2]]
    # TINY: micro-batches of 4 x 32 tokens, 2 a step (one data-parallel rank); 2 layers; 2 kv heads of 16
    expected = _ring_bytes(comm, layers=2, micro=2, batch=4, seq=32, cp=2, kv_heads=2, dim=16)
    assert steps == [expected] * 2, (steps, expected)


ACTIVATIONS = "memory/rank0 activations (MiB per micro-batch)"


@pytest.mark.slow
def test_activations_per_rank_at_cp2_are_about_half_of_one_process(shared_tmp, cache):
    """The bytes autograd saves per micro-batch (the trainer measures its first step) at 1024 tokens:
    CP2's rank holds at most 0.55 of one process's."""
    argv = [*_argv("llama", cache), "--seq-length", "1024", "--micro-batch-size", "1", "--global-batch-size", "1",
            "--train-iters", "1"]  # fmt: skip
    alone = single_process_losses("gpt", argv, os.path.join(shared_tmp, "tb-cp-act-1"), tag=ACTIVATIONS)
    split = train_losses("gpt", [*argv, *CP2], os.path.join(shared_tmp, "tb-cp-act-2"), tag=ACTIVATIONS)
    assert 0 < split[1] <= 0.55 * alone[1], (split, alone)


@pytest.mark.slow
def test_a_context_parallel_checkpoint_resumes_in_one_process(reference, shared_tmp, cache):
    """Saved at step 5 by CP2 ranks (replicas of the same weights), resumed at CP2 and in one
    process: both continue the uninterrupted run."""
    root, argv = os.path.join(shared_tmp, "ckpt-cp2"), _argv("llama", cache)
    first = train_losses("gpt", [*argv, *CP2, "--save", root, "--save-interval", "5", "--exit-interval", "5"],
                         os.path.join(shared_tmp, "tb-cp-save"))  # fmt: skip
    resumed = train_losses("gpt", [*argv, *CP2, "--load", root], os.path.join(shared_tmp, "tb-cp-resume"))
    alone = single_process_losses("gpt", [*argv, "--load", root], os.path.join(shared_tmp, "tb-cp-alone"))
    assert_parity({**first, **resumed}, reference("llama"), 1e-5)
    assert sorted(alone) == list(range(6, 11)) and max(abs(alone[i] - resumed[i]) for i in alone) < 1e-5


@pytest.mark.parametrize("argv, message", [
    (["--seq-length", "30"], "--seq-length 30 must be divisible by 2 x --context-parallel-size 2"),
    (["--engine", "deepspeed"], "--engine deepspeed (ZeRO counts the data-parallel ranks in its batch) is not"),
    (["--reset-attention-mask"], "--reset-attention-mask is not supported with context parallelism"),
    (["--context-parallel-size", "4"], "is not divisible by tensor (1) x pipeline (1) x context (4)"),
    (["--compile"], "--compile with --context-parallel-size 2: torch.compile does not trace"),
    (["--attention-backend", "flash"], "--attention-backend flash (the ring computes attention itself) is not"),
])  # fmt: skip
def test_context_parallelism_it_cannot_run_is_one_error_before_compute(argv, message, shared_tmp, cache, capsys):
    tb = os.path.join(shared_tmp, "tb-cp-refused")
    line = refused_on_every_rank([*_argv("llama", cache), *CP2, "--train-iters", "1", "--tensorboard-dir", tb, *argv],
                                 capsys)  # fmt: skip
    assert message in line, line


LINEAR_ATTENTION = ("minimax", "qwen3_next")  # some layers mix tokens by linear attention: refused
SOFTCAP = ("gemma2", "vaultgemma")  # capped attention scores: refused


@pytest.mark.parametrize("family", [f for f in auto.MODEL_TYPES if f not in (*LINEAR_ATTENTION, *SOFTCAP)])
def test_every_auto_family_at_cp2_computes_what_one_process_does(family):
    """Each family `--schedule auto` verifies, its attention split by the context-parallel plan
    alone: each rank's logits for its tokens, and the weights' gradients summed over the ranks,
    equal the whole model's on the whole sequence (rotary, learned or no positions; latent attention;
    experts)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny(family)).eval()
    whole = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 128, (2, 16), generator=generator)
    weights = torch.randn(2, 16, 128, generator=generator) / 32  # the loss a mean over the 2 x 16 tokens
    (whole(input_ids=ids).logits * weights).sum().backward()
    cp = ContextParallel(dist.group.WORLD, dist.get_rank(), dist.get_world_size())
    sch = ms.create_schedule(model)
    split_attention(sch, cp)
    assert f"attention core: the ring over {cp.size} context-parallel ranks" in sch.explain()
    split = ms.build(sch)
    positions = torch.arange(16).expand(2, 16)
    logits = split(input_ids=cp.local(ids), position_ids=cp.local(positions)).logits
    (logits * cp.local(weights)).sum().backward()
    expected = whole(input_ids=ids).logits.detach()
    torch.testing.assert_close(logits, cp.local(expected), rtol=1e-5, atol=1e-5, msg=family)
    for (name, p), q in zip(split.named_parameters(), whole.parameters(), strict=True):
        if q.grad is None:  # not trained (ernie4_5_moe's routing statistics)
            assert p.grad is None, (family, name)
            continue
        dist.all_reduce(p.grad)
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=f"{family} {name}")


@pytest.mark.parametrize("family, refusal", [("minimax", "its layer model.layers.1 has no attention module"),
                                             ("qwen3_next", "its layer model.layers.0 has no attention module"),
                                             ("gemma2", r"caps its attention scores \(attn_logit_softcapping=50.0\)")])  # fmt: skip
def test_a_model_the_ring_cannot_split_is_refused(family, refusal):
    """MiniMax and Qwen3-Next mix tokens by linear attention in some layers: on a part of the sequence
    they would be wrong, so the plan refuses the model rather than split what it can; Gemma 2 caps
    its attention scores, which the ring does not."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(tiny(family))
    cp = ContextParallel(dist.group.WORLD, dist.get_rank(), dist.get_world_size())
    with pytest.raises(SchedulingError, match=refusal):
        split_attention(ms.create_schedule(model), cp)
