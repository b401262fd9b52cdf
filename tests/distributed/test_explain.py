"""tools/explain.py against a real step: weights, gradients, optimizer state, activations,
collectives and FLOPs of each rank within 10% of what the trainer holds and does (measure.py).

Activations per micro-batch, and the peak, are the ones the trainer logs after its first step
(``> rank R (tensor, pipeline, data) = ...: activations A MiB per micro-batch | peak P MiB``), read
back from the run's output: the run's own numbers are what a user checks explain against.

Weights, gradients and optimizer state are measured from the step's real tensors (the bytes of the
engine's parameters as stored here, of the gradients alive at the optimizer's step, of the
optimizer's state after it), not from the engine's memory report, which explain's formulas share.

Explain plans the run in one plain process over a fake process group (every case of the session in
the same process, ``explain_batch.py``: the imports paid once); the measurement trains the same flags
on these two ranks. Every rank checks its own numbers against its pipeline stage's estimate.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.distributed.measure import measure
from tests.distributed.runs import ROOT, TINY, asked, first_rank_value, plain_env

TP = ["--tensor-model-parallel-size", "2"]
# qwen3_moe under --schedule auto, 4 experts (each token picks 2) of ffn 32 on hidden 64, 2 layers
MOE = ["--model-type", "qwen3_moe", "--schedule", "auto", "--num-query-groups", "2", "--num-experts", "4",
       "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32"]  # fmt: skip
EXPERT_BYTES = 2 * 4 * (2 * 32 * 64 + 64 * 32) * 4  # layers x experts x (gate|up + down) x fp32
CASES = {
    "tp2": TP,
    "tp2-ddp": [*TP, "--engine", "ddp"],
    "tp2-sp": [*TP, "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "zero3": ["--engine", "deepspeed", "--zero-stage", "3"],
    # two micro-batches a step from here on
    "dp2-distributed-optimizer-bf16": ["--use-distributed-optimizer", "--bf16", "--micro-batch-size", "2"],
    "fsdp": ["--engine", "fsdp", "--micro-batch-size", "2"],
}
SLOW_CASES = {  # the slow tier's (the README's suite stays within 20 minutes)
    "tp2-recompute": [*TP, "--recompute-granularity", "full", "--recompute-method", "uniform"],
    "zero3-accumulating": ["--engine", "deepspeed", "--zero-stage", "3", "--micro-batch-size", "2"],
    "tp2-selective-recompute": [*TP, "--recompute-granularity", "selective"],
    "zero2-bf16": ["--engine", "deepspeed", "--zero-stage", "2", "--bf16", "--micro-batch-size", "2"],
    "ep2-qwen3_moe": [*MOE, "--expert-model-parallel-size", "2"],  # whole experts on each rank, tokens to them
    # each rank runs half of every sequence; the keys and values go round the ring, or are gathered
    # (full recompute: once more forward), gradients are reduced over the DP x CP ranks
    "cp2": ["--context-parallel-size", "2"],
    "cp2-allgather-ddp-recompute": [
        *["--context-parallel-size", "2", "--cp-comm-type", "allgather", "--engine", "ddp"],
        *["--recompute-granularity", "full", "--recompute-method", "uniform"],
    ],
}
TOLERANCE = 0.10


def _argv(case: str, shared_tmp: str, cache: str) -> list[str]:
    """The trainer's flags of ``case``: 2 steps of TINY, the collectives counted."""
    return [*TINY, "--schedule", "gpt_tp", "--train-iters", "2", "--eval-iters", "0", "--log-comm",
            "--data-cache-path", cache, "--tensorboard-dir", os.path.join(shared_tmp, f"tb-explain-{case}"),
            *{**CASES, **SLOW_CASES}[case]]  # fmt: skip


@pytest.fixture(scope="module")
def plans(shared_tmp, cache, request):
    """``plan(case)``: tools/explain.py's JSON for ``case`` at world size 2; on first use, every case
    this session runs is planned, by rank 0, in one plain process (``explain_batch.py``)."""
    out = {case: os.path.join(shared_tmp, f"explain-{case}.json") for case in asked(request, "case")}

    def run() -> str | None:
        """On rank 0: plan every case; explain's error, if any."""
        listing = os.path.join(shared_tmp, "explain-batch.json")
        with open(listing, "w") as f:
            json.dump([["--world-size", "2", "--json", path, *_argv(case, shared_tmp, cache)]
                       for case, path in out.items()], f)  # fmt: skip
        cmd = [sys.executable, os.path.join(ROOT, "tests", "distributed", "explain_batch.py"), listing]
        done = subprocess.run(cmd, env=plain_env(), cwd=ROOT, capture_output=True, text=True, timeout=120 * len(out))
        return None if done.returncode == 0 else done.stderr[-3000:]

    errors: list[str | None] = []

    def read(case: str) -> dict:
        with open(out[case]) as f:
            return json.load(f)

    def plan(case: str) -> dict:
        if not errors:
            errors.append(first_rank_value(run))
        assert errors[0] is None, errors[0]
        return first_rank_value(lambda: read(case))

    return plan


def _close(estimated: float, measured: float, what: str) -> None:
    assert abs(estimated - measured) <= TOLERANCE * measured, f"{what}: explain {estimated:,}, measured {measured:,}"


def _is_close(estimated: float, measured: float) -> bool:
    return abs(estimated - measured) <= TOLERANCE * measured


@pytest.mark.parametrize("case", [*CASES, *(pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES)])
def test_explain_is_within_ten_percent_of_a_real_step(case, plans, shared_tmp, cache):
    argv = _argv(case, shared_tmp, cache)
    plan = plans(case)
    measured = measure("gpt", argv)
    estimated = {tuple(r["coordinates"])[1]: r for r in plan["ranks"]}[measured["coordinates"][1]]
    held = measured["held"]  # the real tensors' bytes, counted without the formulas explain and the report share
    wrong = [f"{part}: explain {estimated['memory'][part]:,}, the engine's report {measured['memory'][part]:,}, "
             f"held {held[part]:,}" for part in ("params", "grads", "optimizer")
             if not (_is_close(estimated["memory"][part], held[part]) and _is_close(measured["memory"][part], held[part]))]  # fmt: skip
    if "zero-stage" in " ".join(argv) and "gathered" in estimated["memory"]:  # ZeRO-3: every weight held whole
        # (FSDP's estimate counts the layer it prefetches, which waits in FSDP's buffers, out of the module's sight)
        _close(estimated["memory"]["gathered"], measured["memory"]["gathered"], "weights held whole")
    logged = measured["logged"]  # the run's log line
    assert logged["activations"] > 0 and measured["comm"]
    _close(estimated["activations"], logged["activations"], "activation bytes per micro-batch (logged)")
    if not estimated["memory"].get("gathered"):  # a CPU's peak: saved + weights + gradients + optimizer
        _close(estimated["peak"], logged["peak"], "peak bytes (logged)")
    _close(estimated["flops"], measured["flops"], "FLOPs per step")
    if "--context-parallel-size" in argv:  # the ring's saved tensors and block products, as its kernel's
        assert abs(estimated["activations"] - logged["activations"]) <= 0.005 * 2**20, "beyond the log's rounding"
        assert estimated["flops"] == measured["flops"]
    total = sum(measured["comm"].values())
    assert set(measured["comm"]) <= set(estimated["comm"]), (
        f"explain lists {estimated['comm']}, the run {measured['comm']}"
    )
    for key in sorted(set(measured["comm"]) | set(estimated["comm"])):
        wanted, listed = measured["comm"].get(key, 0), estimated["comm"].get(key, 0)
        if max(wanted, listed) >= 0.01 * total:
            _close(listed, wanted, f"{key} bytes per step")
        elif "--engine" not in argv:  # megatron-core's scalars (the gradient norm, the metrics): exact
            assert listed == wanted, f"{key}: explain {listed:,} bytes per step, the run {wanted:,}"
        if key.endswith("[cp]"):  # the ring's exchange and the loss's sums: counted exactly
            assert listed == wanted, f"{key}: explain {listed:,} bytes per step, the run {wanted:,}"
    assert not wrong, wrong
    if "--expert-model-parallel-size" in argv:  # each rank holds 1/E of the routed experts' weights
        experts = estimated["experts"]
        assert experts["model_params"] == EXPERT_BYTES and experts["expert_data_parallel"] == 1
        assert experts["params"] == measured["experts"] == EXPERT_BYTES // 2
