"""explain's estimate with the attention a GPU's kernel runs (estimate(..., attention="flash"):
megatron_slapo/estimates/kernel_attention.py), and the meta build it plans on."""

import pytest

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--num-workers", "0"]  # fmt: skip
BATCH, HEADS, SEQ, HEAD_DIM, LAYERS, MICRO = 2, 4, 64, 16, 2, 4  # what TINY makes: 4 micro-batches of one rank
MODELS = {"gpt2": ["--schedule", "gpt_tp"], "llama": ["--model-type", "llama", "--num-query-groups", "2"]}  # GQA


def _estimate(tmp_path, flags, attention=None, world=1, rank=0):
    from megatron_slapo.estimates.estimate import estimate

    argv = [*TINY, "--data-cache-path", str(tmp_path / "cache"), *flags]
    return estimate("gpt", argv, world, rank, attention=attention)


@pytest.mark.parametrize("model", MODELS)
def test_flash_keeps_no_scores_and_computes_what_flash_computes(tmp_path, model):
    """Flash keeps q, k, v, the output and a log-sum-exp per row, not the fp32 scores; its backward
    recomputes each layer's q kᵀ (2 b h s² d FLOPs per micro-batch), the one product the math path
    does not run again. Everything else is the same run."""
    math = _estimate(tmp_path, MODELS[model])
    flash = _estimate(tmp_path, MODELS[model], "flash")
    scores = BATCH * HEADS * SEQ * SEQ * 4  # one layer's fp32 s x s per head
    assert flash.activations <= math.activations - LAYERS * scores
    assert flash.flops - math.flops == MICRO * LAYERS * 2 * BATCH * HEADS * SEQ * SEQ * HEAD_DIM
    assert (flash.comm, flash.memory) == (math.comm, math.memory)


def test_flash_through_a_pipeline_a_recomputed_core_and_the_ring(tmp_path):
    """A pipeline stage's attention, and a core that selective recompute runs again in the backward
    (which reads the attention function anew), run the kernel too; a recomputed core keeps only its
    inputs whichever kernel it runs. The context-parallel ring keeps only flash's tensors already."""
    staged = ["--schedule", "gpt_tp", "--pipeline-model-parallel-size", "2"]
    assert _estimate(tmp_path, staged, "flash", world=2).activations < _estimate(tmp_path, staged, world=2).activations
    recomputed = [*MODELS["llama"], "--recompute-granularity", "selective"]
    assert _estimate(tmp_path, recomputed, "flash").activations == _estimate(tmp_path, recomputed).activations
    ring = [*MODELS["llama"], "--context-parallel-size", "2"]
    assert _estimate(tmp_path, ring, "flash", world=2) == _estimate(tmp_path, ring, world=2)


def test_pipeline_ranks_share_one_plan_and_pass(tmp_path, monkeypatch):
    """Ranks that differ only in their pipeline rank (explain's) build the same model, whose pass
    runs every stage: the second reads its stages of the first's, and gets what a plan of its own gives."""
    from megatron_slapo.estimates import estimate as module

    flags = [*MODELS["llama"], "--pipeline-model-parallel-size", "2"]
    planned, prepare = [], module.prepare

    def counted(*args, **kwargs):  # the ranks planned
        planned.append(kwargs["simulate_rank"])
        return prepare(*args, **kwargs)

    monkeypatch.setattr(module, "prepare", counted)
    monkeypatch.setattr(module, "_plans", {})
    first, second = (_estimate(tmp_path, flags, world=2, rank=rank) for rank in (0, 1))
    assert planned == [0] and (first.stages, second.stages) == ([0], [1])
    monkeypatch.setattr(module, "_plans", {})
    assert _estimate(tmp_path, flags, world=2, rank=1) == second and planned == [0, 1]


def test_an_unknown_kernel_is_refused():
    from megatron_slapo.estimates.kernel_attention import attention_kernel

    with pytest.raises(ValueError, match="attention kernel 'math'"):
        attention_kernel("math")


def test_a_meta_build_allocates_nothing(tmp_path):
    """build(..., device="meta"), as explain builds, gives each weight a meta tensor of its shard's
    shape, annotated as a materialised one, tied weights still tied, and allocates no memory for
    them on the way (it used to fill each unit whole on the CPU first)."""
    import torch

    import megatron_slapo as ms
    from megatron_slapo import parallel
    from megatron_slapo.arguments.parser import parse_args
    from megatron_slapo.compat.torch_internals import allocation_events
    from megatron_slapo.training.plan import prepare

    argv = [*TINY, "--data-cache-path", str(tmp_path / "cache"), *MODELS["gpt2"], "--tensor-model-parallel-size", "2"]
    plan = prepare(parse_args("gpt", argv), 2, simulate_rank=0)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            model = ms.build(plan.sch, init_weights=False, device="meta")
    finally:
        parallel.destroy()
    assert max(size for _, size, _ in allocation_events(prof)) <= 8  # the agreed seed; the smallest weight is 256 B
    tensors = [*model.parameters(), *model.buffers()]
    assert tensors and all(t.is_meta for t in tensors)
    qkv = model.get_submodule("transformer.h.0.attn.c_attn").weight
    assert qkv.shape == (64, 3 * 64 // 2) and qkv.tensor_model_parallel  # GPT-2's Conv1D, its columns halved
    assert model.lm_head.weight is model.transformer.wte.weight
    assert isinstance(model.lm_head.weight, torch.nn.Parameter)
