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


# An MoE family under --schedule auto: qwen3_moe, 4 experts of which each token picks 2, every layer
# sparse; its attention has per-head q/k norms (HF's plan: replicated_with_grad_allreduce)
MOE = ["--model-type", "qwen3_moe", "--num-query-groups", "2", "--num-experts", "4", "--moe-router-topk", "2",
       "--moe-ffn-hidden-size", "32"]  # fmt: skip
SCHEDULES = {  # schedule (and a variant after "-") -> (task, flags)
    "gpt_tp": ("gpt", []),
    "gpt_neo_tp": ("gpt", ["--model-type", "gpt_neo"]),
    "opt_tp": ("gpt", ["--model-type", "opt"]),
    "llama_tp": ("gpt", ["--model-type", "llama", "--num-query-groups", "2"]),
    "auto": ("gpt", ["--model-type", "llama", "--num-query-groups", "2"]),  # what llama_tp moves, from HF's plan
    "auto-qwen3_moe": ("gpt", MOE),
    # Gemma 3 (per-head q/k norms, a scaled embedding), Phi-3 (packed q|k|v and gate|up), OLMo 2 (q/k norms
    # over all heads, split)
    **{f"auto-{f}": ("gpt", ["--model-type", f, "--num-query-groups", "2"]) for f in ("gemma3_text", "phi3", "olmo2")},
    "bert_tp": ("bert", []),
}
TOPK, EXPERTS, HEAD_DIM = 2, 4, 64 // 4  # MOE's; TINY's hidden size over its heads
HEAD_NORMS = ("auto-qwen3_moe", "auto-gemma3_text")  # per-head q/k norms: their weights' gradients are partial sums
# OLMo 2's q/k norms span all heads: each all-reduces its b·s sums of squares forward, and their gradient backward
SPLIT_NORM_SUMS = {"auto-olmo2": 2 * 2}  # per layer, in b·s numbers


@pytest.mark.parametrize("case", SCHEDULES)
def test_tp2_bytes_per_step_equal_megatrons_count(case, shared_tmp, cache):
    """Megatron's count, per micro-batch: tensor parallelism all-reduces b·s·h activations twice per
    layer forward (attention and MLP outputs) and twice backward (the gradients of the attention
    and MLP inputs: once per block, however many column-parallel projections read the input), once
    for the vocabulary-parallel embedding's output and once for the LM head input's gradient; the
    vocabulary-parallel cross-entropy all-reduces three b·s tensors (the maxima; the target logits
    with the sums of exponentials, in one call). The optimizer step adds one all-reduce of a scalar (the gradient norm).

    An MoE block (qwen3_moe) moves what an MLP does (its experts' output all-reduced forward, the
    gradient of their token rows backward: the router is replicated, so its own part of the input
    gradient is whole and the reduction sits on the experts' inputs), plus, backward, the gradient
    of the routing weights the experts were called with (b·s·k: each rank's experts see their part
    of the features only, so the gradient of the weight that scales their output is a partial sum).
    Qwen3's (and Gemma 3's) per-head q/k norms see only this rank's heads: their weights' gradients
    (head_dim each) are partial sums, all-reduced once a step. OLMo 2's q/k norms span all heads:
    split with them, each all-reduces its b·s sums of squares forward and their gradient backward
    (Megatron's placement, where HF's plan gathers q, k and v). Phi-3's packed projections move
    nothing more than Llama's separate ones."""
    task, flags = SCHEDULES[case]
    schedule = case.partition("-")[0]
    b, s, h, layers, micro = 4, 32, 64, 2, 2  # TINY: global batch 8 = 2 micro-batches of 4 on one DP rank
    tb = os.path.join(shared_tmp, f"tb-comm-{case}")
    train_losses(task, [*TINY, *flags, "--schedule", schedule, "--tensor-model-parallel-size", "2",
                        "--train-iters", "3", "--eval-iters", "0", "--log-comm", "--data-cache-path", cache], tb)  # fmt: skip
    tags = last_rank_value(lambda: sorted(t for t in tb_tags(tb) if "comm" in t))
    measured = last_rank_value(lambda: tb_scalars(tb, "comm-bytes/all_reduce[tp]"))
    norm = last_rank_value(lambda: tb_scalars(tb, "comm-bytes/all_reduce[mp]"))
    fp32 = 4
    per_micro = (4 * layers + 2) * b * s * h + 3 * b * s + layers * SPLIT_NORM_SUMS.get(case, 0) * b * s
    per_step = layers * 2 * HEAD_DIM if case in HEAD_NORMS else 0  # q_norm and k_norm gradients
    if case == "auto-qwen3_moe":
        per_micro += layers * b * s * TOPK  # the routing weights' gradient, per MoE block
    expected = (micro * per_micro + per_step) * fp32
    assert tags == ["comm-bytes/all_reduce[mp]", "comm-bytes/all_reduce[tp]"]  # nothing else under pure TP
    assert measured == {1: expected, 2: expected, 3: expected}, (measured, expected)
    assert norm == {1: fp32, 2: fp32, 3: fp32}, norm


def test_tp2_t5_bytes_per_step_equal_megatrons_count(shared_tmp, cache):
    """t5_tp at TP2, per micro-batch of encoder length s and decoder length t (h = d_model, L layers
    in each stack), in fp32:

    - each stack looks the vocabulary-parallel shared embedding up once: an all-reduce of b·s·h
      (encoder) and of b·t·h (decoder) forward;
    - an encoder layer is two Megatron blocks (self-attention, FFN): 4 all-reduces of b·s·h;
    - a decoder layer is three blocks on b·t·h (self-attention, cross-attention, FFN: 6
      all-reduces), and its cross-attention's fused k|v reads the encoder's output: one more
      all-reduce, of that input's gradient (b·s·h), per decoder layer;
    - the (tied) vocabulary-parallel LM head all-reduces its input's gradient (b·t·h) and the
      vocabulary-parallel cross-entropy three b·t tensors;
    - the relative position bias keeps this rank's heads' columns and moves nothing.

    Once a step: the gradient norm (a scalar, over the model-parallel group)."""
    b, s, t, h, layers, micro, fp32 = 4, 32, 16, 64, 2, 2, 4  # TINY's shape, --decoder-seq-length 16
    tb = os.path.join(shared_tmp, "tb-comm-t5_tp")
    train_losses("t5", [*TINY, "--decoder-seq-length", "16", "--schedule", "t5_tp", "--tensor-model-parallel-size",
                        "2", "--train-iters", "2", "--eval-iters", "0", "--log-comm", "--data-cache-path", cache], tb)  # fmt: skip
    tags = last_rank_value(lambda: sorted(t for t in tb_tags(tb) if "comm" in t))
    measured = last_rank_value(lambda: tb_scalars(tb, "comm-bytes/all_reduce[tp]"))
    encoder = (1 + 4 * layers + layers) * b * s * h  # embedding, layers, the decoder's reads of its output
    decoder = (1 + 6 * layers + 1) * b * t * h + 3 * b * t  # embedding, layers, head; the loss
    expected = micro * (encoder + decoder) * fp32
    assert tags == ["comm-bytes/all_reduce[mp]", "comm-bytes/all_reduce[tp]"]  # nothing else under pure TP
    assert measured == {1: expected, 2: expected}, (measured, expected)


def test_tp2_wideresnet_bytes_per_step_equal_the_channel_split_count(shared_tmp):
    """wideresnet_tp at TP2, per micro-batch of b images, in fp32. Each bottleneck block (input
    c_in x H x W, width w, output c_out x H' x W', H' = H / stride) is, in Megatron's terms, a
    column-parallel 1x1 (and projection shortcut) reading the block's whole input, a row-parallel 3x3,
    then a column-parallel 1x1 expand reading a replicated input again; its output channels are
    gathered for the next block:

    - all-reduce: the 3x3's output forward (b·w·H'·W'), the expand's input gradient backward
      (b·w·H'·W'), and the block input's gradient backward (b·c_in·H·W, once for conv1 and the
      shortcut);
    - all-gather: the block's output channels (b·c_out·H'·W' gathered; backward each rank keeps its
      own channels' gradient, no collective).

    The stem and the classifier are replicated and move nothing; the gradient norm is one scalar.
    Here: stem 8 channels at 8x8 (small images: no stride, no pool); layer1.0 (w 4, c_out 32,
    stride 1) and layer2.0 (w 8, c_out 64, stride 2, so 4x4)."""
    b, micro, fp32 = 4, 2, 4
    tb = os.path.join(shared_tmp, "tb-comm-wideresnet_tp")
    train_losses("vision", ["--schedule", "wideresnet_tp", "--tensor-model-parallel-size", "2", "--resnet-layers", "1",
                            "1", "--base-channels", "8", "--width-per-group", "32", "--img-h", "8", "--img-w", "8",
                            "--num-classes", "4", "--micro-batch-size", "4", "--global-batch-size", "8",
                            "--train-iters", "2", "--eval-iters", "0", "--log-comm"], tb, tag="loss")  # fmt: skip
    tags = last_rank_value(lambda: sorted(t for t in tb_tags(tb) if "comm" in t))
    measured = {op: last_rank_value(lambda op=op: tb_scalars(tb, f"comm-bytes/{op}[tp]"))
                for op in ("all_reduce", "all_gather_single")}  # fmt: skip
    blocks = [(8, 8 * 8, 4, 32, 8 * 8), (32, 8 * 8, 8, 64, 4 * 4)]  # (c_in, H·W, w, c_out, H'·W')
    reduced = sum(c_in * hw + 2 * w * hw_out for c_in, hw, w, _, hw_out in blocks)
    gathered = sum(c_out * hw_out for _, _, _, c_out, hw_out in blocks)
    expected = {"all_reduce": micro * b * reduced * fp32, "all_gather_single": micro * b * gathered * fp32}
    assert tags == ["comm-bytes/all_gather_single[tp]", "comm-bytes/all_reduce[mp]", "comm-bytes/all_reduce[tp]"]
    assert measured == {op: {1: v, 2: v} for op, v in expected.items()}, (measured, expected)


@pytest.mark.parametrize("case", SCHEDULES)
def test_tp2_sequence_parallel_bytes_per_step_equal_megatrons_count(case, shared_tmp, cache):
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
      ``finalize_model_grads`` does.

    qwen3_moe's MoE block runs its router on this rank's tokens and hands the experts all tokens:
    its token rows are gathered and its output reduce-scattered as an MLP's are, and its routing
    weights (b·s·k, fp32) are all-gathered forward and reduce-scattered backward and its choices
    (b·s·k, int64, no gradient) all-gathered; once a step the router's weights (experts x h, having
    seen part of the sequence) and the q/k norms' (per-head, partial) gradients are all-reduced
    with the other split weights'."""
    task, flags = SCHEDULES[case]
    schedule = case.partition("-")[0]
    b, s, h, layers, micro, fp32 = 4, 32, 64, 2, 2, 4
    tb = os.path.join(shared_tmp, f"tb-comm-sp-{case}")
    train_losses(task, [*TINY, *flags, "--schedule", schedule, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                        "--train-iters", "2", "--eval-iters", "0", "--log-comm", "--data-cache-path", cache], tb)  # fmt: skip
    measured = {op: last_rank_value(lambda op=op: tb_scalars(tb, f"comm-bytes/{op}[tp]"))
                for op in ("all_reduce", "all_gather_single", "reduce_scatter_single")}  # fmt: skip
    activation, loss = micro * b * s * h * fp32, micro * 3 * b * s * fp32
    positions = schedule not in ("llama_tp", "auto")
    split_weights = {  # per layer: norms and row-parallel biases; then the modules after the layers
        "gpt_tp": layers * 6 * h + 2 * h, "gpt_neo_tp": layers * 6 * h + 2 * h, "opt_tp": layers * 6 * h + 2 * h,
        "llama_tp": layers * 2 * h + h, "auto": layers * 2 * h + h, "bert_tp": layers * 6 * h + (h * h + h) + 2 * h,
        "auto-qwen3_moe": layers * (2 * h + EXPERTS * h + 2 * HEAD_DIM) + h,  # norms, router, q/k norms; final norm
        "auto-gemma3_text": layers * (4 * h + 2 * HEAD_DIM) + h,  # four norms a layer (before and after each block)
        "auto-phi3": layers * 2 * h + h, "auto-olmo2": layers * 2 * h + h,
    }[case]  # fmt: skip
    pooler = schedule == "bert_tp"
    routing = micro * layers * b * s * TOPK if case == "auto-qwen3_moe" else 0  # routing weights (and choices)
    int64 = 8
    expected = {
        "all_reduce": (activation if positions else 0)
        + loss
        + split_weights * fp32
        + micro * layers * SPLIT_NORM_SUMS.get(case, 0) * b * s * fp32,
        "all_gather_single": (4 * layers + 2 + pooler) * activation + routing * (fp32 + int64),
        "reduce_scatter_single": (4 * layers + 1 + (not positions)) * activation + routing * fp32,
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
