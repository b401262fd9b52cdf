"""--log-comm: collective bytes counted per op and group, checked against Megatron's analytic count."""

import os

import pytest
import torch
import torch.distributed as dist

from megatron_slapo.parallel import collectives, tensor_parallel_group
from megatron_slapo.parallel.comm_log import CommLog
from tests.distributed.conftest import use_layout
from tests.distributed.runs import TINY, last_rank_value, train_losses
from tests.utils import tb_scalars, tb_tags


def test_each_collective_counts_once_and_point_to_point_still_works(rank):
    use_layout(2)
    originals = dist.all_reduce, dist.isend
    log = CommLog().install()
    try:
        x = torch.ones(10)
        dist.all_reduce(x, group=tensor_parallel_group())
        dist.all_gather_into_tensor(torch.empty(20), torch.ones(10))  # deprecated name -> all_gather_single
        collectives.all_gather(torch.ones(2, 3), 0, tensor_parallel_group())  # our TP ops: counted too
        collectives.reduce_scatter(torch.ones(4, 3), 0, tensor_parallel_group())
        peer = 1 - rank
        ops = [dist.P2POp(dist.isend, torch.ones(3), peer), dist.P2POp(dist.irecv, torch.empty(3), peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        counts = log.take()
    finally:
        log.uninstall()
    assert (dist.all_reduce, dist.isend) == originals
    assert counts == {"all_reduce[tp]": 40, "all_gather_into_tensor[world]": 80, "isend[world]": 12, "irecv[world]": 12,
                      "all_gather_single[tp]": 48, "reduce_scatter_single[tp]": 48}  # fmt: skip
    assert log.take() == {}


SCHEDULES = {  # schedule -> (task, flags)
    "gpt_tp": ("gpt", []),
    "gpt_neo_tp": ("gpt", ["--model-type", "gpt_neo"]),
    "opt_tp": ("gpt", ["--model-type", "opt"]),
    "llama_tp": ("gpt", ["--model-type", "llama", "--num-query-groups", "2"]),
    "auto": ("gpt", ["--model-type", "llama", "--num-query-groups", "2"]),  # what llama_tp moves, from HF's plan
    "bert_tp": ("bert", []),
}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tp2_bytes_per_step_equal_megatrons_count(schedule, shared_tmp, cache):
    """Megatron's count, per micro-batch: tensor parallelism all-reduces b·s·h activations twice per
    layer forward (attention and MLP outputs) and twice backward (the gradients of the attention
    and MLP inputs: once per block, however many column-parallel projections read the input), once
    for the vocabulary-parallel embedding's output and once for the LM head input's gradient; the
    vocabulary-parallel cross-entropy all-reduces three b·s tensors (the maxima; the target logits
    with the sums of exponentials, in one call). The optimizer step adds one all-reduce of a scalar (the gradient norm)."""
    task, flags = SCHEDULES[schedule]
    b, s, h, layers, micro = 4, 32, 64, 2, 2  # TINY: global batch 8 = 2 micro-batches of 4 on one DP rank
    tb = os.path.join(shared_tmp, f"tb-comm-{schedule}")
    train_losses(task, [*TINY, *flags, "--schedule", schedule, "--tensor-model-parallel-size", "2",
                        "--train-iters", "3", "--eval-iters", "0", "--log-comm", "--data-cache-path", cache], tb)  # fmt: skip
    tags = last_rank_value(lambda: sorted(t for t in tb_tags(tb) if "comm" in t))
    measured = last_rank_value(lambda: tb_scalars(tb, "comm-bytes/all_reduce[tp]"))
    norm = last_rank_value(lambda: tb_scalars(tb, "comm-bytes/all_reduce[mp]"))
    fp32 = 4
    expected = micro * ((4 * layers + 2) * b * s * h + 3 * b * s) * fp32
    assert tags == ["comm-bytes/all_reduce[mp]", "comm-bytes/all_reduce[tp]"]  # nothing else under pure TP
    assert measured == {1: expected, 2: expected, 3: expected}, (measured, expected)
    assert norm == {1: fp32, 2: fp32, 3: fp32}, norm


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tp2_sequence_parallel_bytes_per_step_equal_megatrons_count(schedule, shared_tmp, cache):
    """Megatron's count with --sequence-parallel, per micro-batch of b·s·h activations:

    - each layer enters its two regions by all-gathering the sequence and leaves them by
      reduce-scattering (forward), and the converse backward: 4 all-gathers and 4 reduce-scatters
      per layer in place of 4 all-reduces (Megatron-LM's column-parallel layers also gather their
      input again for the weight gradient, to save memory; we keep the gathered input instead);
    - start: with position embeddings (GPT-2, GPT-Neo, OPT, BERT) the lookup is all-reduced and the
      first layer keeps its part (all-gather backward); without (Llama) the lookup is
      reduce-scattered (all-gather backward), Megatron's ``reduce_scatter_embeddings``;
    - end: the final norm runs on the split sequence and the head's input is all-gathered
      (reduce-scatter backward); BERT's pooler gathers the sequence too (its backward keeps this
      rank's part); the loss all-reduces three b·s tensors;
    - once a step, the gradients of the weights that saw part of the sequence (norms, row-parallel
      biases, BERT's MLM transform) are all-reduced over the tensor-parallel ranks, as Megatron's
      ``finalize_model_grads`` does."""
    task, flags = SCHEDULES[schedule]
    b, s, h, layers, micro, fp32 = 4, 32, 64, 2, 2, 4
    tb = os.path.join(shared_tmp, f"tb-comm-sp-{schedule}")
    train_losses(task, [*TINY, *flags, "--schedule", schedule, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                        "--train-iters", "2", "--eval-iters", "0", "--log-comm", "--data-cache-path", cache], tb)  # fmt: skip
    measured = {op: last_rank_value(lambda op=op: tb_scalars(tb, f"comm-bytes/{op}[tp]"))
                for op in ("all_reduce", "all_gather_single", "reduce_scatter_single")}  # fmt: skip
    activation, loss = micro * b * s * h * fp32, micro * 3 * b * s * fp32
    positions = schedule not in ("llama_tp", "auto")
    split_weights = {  # per layer: norms and row-parallel biases; then the modules after the layers
        "gpt_tp": layers * 6 * h + 2 * h, "gpt_neo_tp": layers * 6 * h + 2 * h, "opt_tp": layers * 6 * h + 2 * h,
        "llama_tp": layers * 2 * h + h, "auto": layers * 2 * h + h, "bert_tp": layers * 6 * h + (h * h + h) + 2 * h,
    }[schedule]  # fmt: skip
    pooler = schedule == "bert_tp"
    expected = {
        "all_reduce": (activation if positions else 0) + loss + split_weights * fp32,
        "all_gather_single": (4 * layers + 2 + pooler) * activation,
        "reduce_scatter_single": (4 * layers + 1 + (not positions)) * activation,
    }
    assert measured == {op: {1: v, 2: v} for op, v in expected.items()}, (measured, expected)


def test_pipeline_stages_share_the_metrics_without_pickling_every_step(shared_tmp, cache, monkeypatch):
    """The last stage tells the others its metric names once (for training, once for evaluation);
    each step's values then travel as one tensor, not a pickled object."""
    from megatron.core import parallel_state as ps

    pickled = []
    broadcast_object_list = dist.broadcast_object_list

    def counting(objects, src=None, group=None, **kwargs):
        if group is not None and group is ps.get_pipeline_model_parallel_group():
            pickled.append(list(objects))
        return broadcast_object_list(objects, src=src, group=group, **kwargs)

    monkeypatch.setattr(dist, "broadcast_object_list", counting)
    tb = os.path.join(shared_tmp, "tb-pp-metrics")
    losses = train_losses("gpt", [*TINY, "--engine", "megatron", "--pipeline-model-parallel-size", "2",
                                  "--train-iters", "4", "--eval-interval", "2", "--eval-iters", "1", "--log-interval",
                                  "1", "--data-cache-path", cache], tb)  # fmt: skip
    assert sorted(losses) == [1, 2, 3, 4]
    assert len(pickled) == 2, pickled
