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
