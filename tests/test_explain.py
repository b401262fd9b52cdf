"""tools/explain.py as a user runs it: one process plans any world size (the estimates themselves
are checked against real steps in tests/distributed/test_explain.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--num-workers", "0", "--schedule", "gpt_tp"]  # fmt: skip


def _explain(tmp_path, *flags):
    cmd = [
        sys.executable,
        "tools/explain.py",
        *TINY,
        *flags,
        "--data-cache-path",
        str(tmp_path / "cache"),
    ]  # flags last: they win
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_explain_plans_four_ranks_in_one_process(tmp_path):
    out = tmp_path / "plan.json"
    done = _explain(tmp_path, "--world-size", "4", "--json", str(out), "--tensor-model-parallel-size", "2",
                    "--pipeline-model-parallel-size", "2", "--recompute-granularity", "selective")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    text = done.stdout
    assert "What the schedule did (rank 0):" in text and "transformer.h.1                   cut_pipeline_stage" in text
    assert "lm_head                           column-parallel" in text
    assert "transformer.h.*.attn (x2)         checkpoint attention core; fork_rng" in text
    assert "Pipeline bubble: 20.0% of each step idle (2 pipeline ranks, 1 stage(s) each, 4 micro-batches)" in text
    plan = json.loads(out.read_text())
    ranks = plan["ranks"]
    assert plan["world_size"] == 4 and [r["rank"] for r in ranks] == [0, 2]
    assert [r["coordinates"] for r in ranks] == [[0, 0, 0], [0, 1, 0]]
    first, last = ranks
    assert first["in_flight"] == 2 and last["in_flight"] == 1  # 1F1B's warm-up
    assert last["flops"] > first["flops"]  # the head and the loss are on the last stage
    for r in ranks:
        assert r["micro_batches"] == 4 and r["activations"] > 0
        assert r["memory"]["optimizer"] == 2 * r["memory"]["params"]  # fp32 AdamW on megatron-core's DDP
        assert r["comm"]["isend[pp]"] == r["comm"]["irecv[pp]"] == 4 * 2 * 32 * 64 * 4  # b s h fp32, 4 micro-batches
        assert r["comm"]["all_reduce[embd]"] > 0 and r["comm"]["all_reduce[tp]"] > 0
        # the scalars --log-comm logs too: megatron-core's gradient norm summed over the model-parallel
        # ranks (fp32), the loss sent from the last stage to the others
        assert r["comm"]["all_reduce[mp]"] == 4 and r["comm"]["broadcast[pp]"] == 4
        assert r["peak"] == sum(r["memory"].values()) + r["activations"] * r["in_flight"]


def test_explain_refuses_a_layout_the_world_cannot_hold(tmp_path):
    done = _explain(tmp_path, "--world-size", "3", "--tensor-model-parallel-size", "2")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "explain.py: error: world size 3 is not divisible by tensor (2) x pipeline (1) parallel sizes"
    ]


# qwen3_moe under --schedule auto: 4 experts of ffn 32 on hidden 64, each token picks 2, 2 layers
MOE = ["--model-type", "qwen3_moe", "--schedule", "auto", "--num-query-groups", "2", "--num-experts", "4",
       "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32"]  # fmt: skip


@pytest.mark.slow  # tests/distributed/test_explain.py checks it against a real EP2 step, slow too
def test_explain_plans_expert_parallelism(tmp_path):
    """--expert-model-parallel-size 2 on 4 ranks: each rank holds half the routed experts (their
    gradients reduced over the 2 ranks holding the same ones), and moves each micro-batch's tokens x
    top-k rows of hidden out to the experts and back, forward and backward (tests/distributed/
    test_explain.py checks all of it against a real step)."""
    out = tmp_path / "plan.json"
    done = _explain(tmp_path, "--world-size", "4", "--json", str(out), *MOE, "--expert-model-parallel-size", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("Routed experts, rank 0: split across 2 expert-parallel ranks (whole experts), each by its features "
            "across 1; gradients reduced over an expert-data-parallel group of 2") in done.stdout  # fmt: skip
    (rank,) = json.loads(out.read_text())["ranks"]
    experts = 2 * 4 * (2 * 32 * 64 + 64 * 32) * 4  # layers x experts x (gate|up + down) x fp32
    assert rank["experts"] == {"expert_parallel": 2, "expert_tensor_parallel": 1, "expert_data_parallel": 2,
                               "params": experts // 2, "model_params": experts}  # fmt: skip
    assert rank["micro_batches"] == 1
    tokens = 2 * 32  # this rank's micro-batch
    assert rank["comm"]["all_to_all[ep]"] == 2 * tokens * 2 * 64 * 4 * 4  # layers x tokens x top-k x hidden x fp32 x 4
    assert rank["comm"]["all_reduce[edp]"] == experts // 2  # the experts' fp32 gradients, over their copies
    dense = rank["memory"]["params"] - experts // 2
    assert rank["comm"]["all_reduce[dp-cp]"] == dense  # the rest over every data-parallel rank


def _estimate(tmp_path, world, *flags):
    """One rank's estimate in this process (the stack imported once for the cases below)."""
    from megatron_slapo.estimates.estimate import estimate

    argv = [*TINY, "--seq-length", "64", "--data-cache-path", str(tmp_path / "cache"), *flags]
    return estimate("gpt", argv, world, 0)


def test_explain_knows_the_context_parallel_size(tmp_path):
    """At CP2 each rank runs half of every sequence, moves the ring's keys and values as
    --log-comm counts them (tests/distributed/test_explain.py checks both against real steps) and
    reduces its gradients over the data-parallel x context-parallel ranks."""
    one = _estimate(tmp_path, 1)
    ring = _estimate(tmp_path, 2, "--context-parallel-size", "2")
    gathered = _estimate(tmp_path, 2, "--context-parallel-size", "2", "--cp-comm-type", "allgather",
                         "--recompute-granularity", "selective")  # fmt: skip
    assert ring.context_parallel == 2 and ring.micro_batches == one.micro_batches == 4  # one data-parallel rank
    assert ring.activations <= 0.55 * one.activations
    # the keys and values stacked: 2 x batch 2 x 4 heads x 32 tokens x 16 dims x fp32, per layer and micro-batch
    block, layers_micro = 2 * 2 * 4 * 32 * 16 * 4, 2 * 4
    # p2p: one hop forward; backward one hop of the block and two of its fp32 gradient
    assert ring.comm["isend[cp]"] == ring.comm["irecv[cp]"] == layers_micro * 4 * block
    # all-gather of both blocks, again for the recomputed core and in the backward; their gradients reduce-scattered
    assert gathered.comm["all_gather_single[cp]"] == layers_micro * 3 * 2 * block
    assert gathered.comm["reduce_scatter_single[cp]"] == layers_micro * 2 * block
    assert ring.comm["all_reduce[cp]"] == 4 * 8  # the loss's sum and token count, fp32, per micro-batch
    grads = ring.memory["params"]  # megatron-core's fp32 gradients, over both ranks; the metric with them
    assert ring.comm["all_reduce[dp-cp]"] == grads + 4 and "all_reduce[dp-cp]" not in one.comm


def test_the_ring_on_meta_saves_computes_and_reaches_what_the_kernel_does():
    """explain's meta pass runs the context-parallel attention on meta: it must save the bytes the
    real kernel saves and count its FLOPs, forward and backward (one rank: the real one runs here)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_slapo.compat.torch_internals import storage_key
    from megatron_slapo.kernels.ring_attention import context_attention, observing_meta
    from megatron_slapo.parallel.context import ContextParallel

    def measure(device: str, cp: ContextParallel, window: int | None = 3) -> tuple[int, int, list]:
        q = torch.randn(2, 4, 16, 8, device=device).transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
        k, v = (torch.randn(2, 2, 16, d, device=device, requires_grad=True) for d in (8, 6))
        seen, calls = {}, []

        def pack(t: torch.Tensor) -> torch.Tensor:  # each storage's bytes once, as explain counts them
            seen[storage_key(t.untyped_storage())] = t.untyped_storage().nbytes()
            return t

        with (FlopCounterMode(display=False) as flops, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
              observing_meta(lambda phase, *_: calls.append(phase))):  # fmt: skip
            out = context_attention(q, k, v, cp, scale=0.3, window=window)
            grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape] and out.shape == (2, 4, 16, 6)
        return sum(seen.values()), flops.get_total_flops(), calls

    alone = ContextParallel(group=None, rank=0, size=1)
    saved, flops, calls = measure("meta", alone)
    assert (saved, flops) == measure("cpu", alone)[:2] and calls == ["forward", "backward"]
    assert measure("cpu", alone, None)[1] == flops  # the window skips no chunk pair of two here
    # the same 16 tokens as one of two ranks' (chunks 1 and 2 of 4): they see 5 chunks of keys, not 3
    assert measure("meta", ContextParallel(group=None, rank=1, size=2), None)[1] == flops * 5 // 3
