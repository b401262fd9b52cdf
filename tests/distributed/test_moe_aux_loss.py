"""An MoE model's load-balancing loss (``--moe-aux-loss-coeff``) under tensor and sequence
parallelism: the one-device value, and the losses of one process over 10 steps."""

from __future__ import annotations

import os

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from megatron_slapo.training.loop import pretrain
from megatron_slapo.training.moe_loss import LoadBalancingLoss
from tests.distributed.runs import (
    PARITY,
    assert_parity,
    first_rank_value,
    last_rank_value,
    single_process_batch,
    train_losses,
)
from tests.utils import max_diff, tb_scalars

EXPERTS, TOP_K, LAYERS, BATCH, SEQ = 4, 2, 3, 2, 8


def test_gathered_router_logits_give_the_one_device_loss_and_gradients(group, rank, world):
    """Each rank's routers saw its chunk of every sample's sequence (sequence parallelism): the loss
    is one device's over all tokens, and each rank's logits get their rows of one device's gradient."""
    generator = torch.Generator().manual_seed(0)
    whole = [torch.randn(BATCH, SEQ, EXPERTS, generator=generator, requires_grad=True) for _ in range(LAYERS)]
    expected = load_balancing_loss_func(tuple(x.reshape(-1, EXPERTS) for x in whole), EXPERTS, TOP_K, None)
    expected.backward()
    chunk = SEQ // world
    mine = [x.detach()[:, rank * chunk : (rank + 1) * chunk].reshape(-1, EXPERTS).requires_grad_() for x in whole]
    loss = LoadBalancingLoss(load_balancing_loss_func, EXPERTS, TOP_K, 1.0, group)(tuple(mine), BATCH * SEQ)
    loss.backward()
    assert max_diff(loss, expected) < 1e-6 and expected.item() > 1.0  # (top-k is its value when balanced)
    for x, y in zip(mine, whole, strict=True):
        assert max_diff(x.grad, y.grad[:, rank * chunk : (rank + 1) * chunk].reshape(-1, EXPERTS)) < 1e-6
        assert x.grad.abs().sum() > 0


# qwen3_moe (4 experts, top-2) trained 10 fp32 steps with the loss on, at TP2 and TP2 + SP, against one process
MOE = [*PARITY, "--lr", "1e-2", "--min-lr", "1e-3", "--model-type", "qwen3_moe", "--schedule", "auto",
       "--num-query-groups", "2", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32"]  # fmt: skip
AUX = ["--moe-aux-loss-coeff", "0.1"]
TP2 = ["--tensor-model-parallel-size", "2"]
TAGS = ("lm loss", "load balancing loss")


@pytest.fixture(scope="module")
def one_process(shared_tmp, cache) -> dict[str, dict[str, dict[int, float]]]:
    """One process's losses, with the load-balancing loss on and off (one plain process for both)."""
    runs = {"on": [*MOE, *AUX], "off": MOE}
    tb = {name: os.path.join(shared_tmp, f"tb-moe-aux-reference-{name}") for name in runs}
    single_process_batch([("gpt", [*argv, "--data-cache-path", cache], tb[name]) for name, argv in runs.items()],
                         shared_tmp)  # fmt: skip
    return {"on": first_rank_value(lambda: {tag: tb_scalars(tb["on"], tag) for tag in TAGS}),
            "off": first_rank_value(lambda: {"lm loss": tb_scalars(tb["off"], "lm loss")})}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("flags", [TP2, [*TP2, "--sequence-parallel"]], ids=["tp2", "tp2-sp"])
def test_moe_aux_loss_trains_as_one_process(flags, one_process, shared_tmp, cache, request):
    """The loss backpropagated includes coefficient x the load-balancing loss, computed over the
    micro-batch's tokens as on one device: the language-modelling loss is one process's, which the
    load-balancing loss did change. The load-balancing loss itself counts each expert's top-k
    choices, a step function: where rounding decides a near tie of two experts' probabilities the
    other way (more often as training goes on), it moves by up to ``experts / rows x`` the two
    experts' mean probabilities' difference (up to 5e-4 here, from step 7); on the first step,
    before any update, it is one process's to rounding."""
    tb = os.path.join(shared_tmp, f"tb-moe-aux-{request.node.callspec.id}")
    lm = train_losses("gpt", [*MOE, *AUX, *flags, "--data-cache-path", cache], tb)
    aux = last_rank_value(lambda: tb_scalars(tb, "load balancing loss"))
    expected, off = one_process["on"], one_process["off"]["lm loss"]
    assert_parity(lm, expected["lm loss"], 1e-5)
    assert max(abs(expected["lm loss"][i] - off[i]) for i in off) > 1e-2  # the load-balancing loss changed the run
    assert sorted(aux) == sorted(expected["load balancing loss"]) == list(range(1, 11))
    assert abs(aux[1] - expected["load balancing loss"][1]) < 1e-6
    assert max(abs(aux[i] - v) for i, v in expected["load balancing loss"].items()) < 2e-3, (aux, expected)
    assert min(expected["load balancing loss"].values()) > 1.0  # top-k (2) when balanced: not a zero left out


def test_the_load_balancing_loss_under_pipeline_parallelism_is_refused(cache, capsys):
    """One line (rank 0's; the other rank agrees and stays silent), before compute: HF's loss pools
    all layers' statistics, which pipeline stages hold apart."""
    with pytest.raises(SystemExit) as exit_:
        pretrain("gpt", [*MOE, *AUX, "--pipeline-model-parallel-size", "2", "--data-cache-path", cache])
    mine = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    lines = first_rank_value(lambda: mine)
    assert exit_.value.code == 2 and len(lines) == 1 and mine in ([], lines), (lines, mine)
    assert lines[0].startswith("pretrain_gpt.py: error: --moe-aux-loss-coeff 0.1: the load-balancing loss pools the "
                               "routing statistics of every layer, which --pipeline-model-parallel-size 2 puts on "
                               "different stages"), lines[0]  # fmt: skip
