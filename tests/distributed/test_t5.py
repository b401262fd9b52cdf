"""T5 under ``t5_tp``: Verify (outputs and every gradient, both FFN kinds), and
``pretrain_t5.py`` at TP2 (with and without recompute), PP2 and TP2 x PP2 trains as one process
does. Export both ways: test_trainer.py's HF round trip."""

import os

import pytest
import torch

import megatron_slapo as ms
from schedules import t5_tp
from tests.distributed.runs import PARITY, assert_parity, layout_case, reference_losses, train_losses
from tests.utils import tiny_t5

# Megatron pads the vocabulary (4096 words, [BOS], [EOS], 100 sentinels) to a multiple of
# --make-vocab-size-divisible-by x TP: 128 x 1 and 64 x 2 give both layouts the same 4224 rows.
T5 = [*PARITY, "--decoder-seq-length", "16", "--lr", "2e-3"]
SINGLE = ["--make-vocab-size-divisible-by", "128"]
TP2 = ["--schedule", "t5_tp", "--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"]


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("gated", [False, True], ids=["t5-v1.0", "t5-v1.1"])
def test_t5_tp_matches_the_unscheduled_model(group, gated):
    with torch.device("meta"):
        model = tiny_t5(gated).eval()
    ids = torch.randint(2, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    decoder_ids = torch.randint(2, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    sch = ms.create_schedule(model, group)
    inputs = {"input_ids": ids, "decoder_input_ids": decoder_ids, "use_cache": False}
    with ms.Verify(sch, [], inputs, seed=7) as verify:
        t5_tp.apply(sch, model.config)
    assert verify.report.grads and not verify.report.failures
    split = {path for path, node in sch.named_schedules() if node.metadata.shards}
    assert {"shared", "encoder.block.0.layer.0.SelfAttention.relative_attention_bias",
            "decoder.block.0.layer.0.SelfAttention.relative_attention_bias", "decoder.block.1.layer.1.EncDecAttention.k",
            "decoder.block.1.layer.2.DenseReluDense.wo"} <= split, split  # fmt: skip
    assert not any("layer_norm" in path for path in split), split
    fused = {path for path, node in sch.named_schedules() if hasattr(node.mod, "shared_input")}
    gate_up = {f"{stack}.block.{i}.layer.{ffn}.DenseReluDense.{w}" for stack, ffn in (("encoder", 1), ("decoder", 2))
               for i in range(2) for w in ("wi_0", "wi_1")}  # fmt: skip
    assert (gate_up <= fused) == gated and not any(".wi" in path for path in fused - gate_up), fused


@pytest.fixture(scope="module")
def reference(shared_tmp, cache):
    return reference_losses(shared_tmp, lambda key: ("t5", [*T5, *SINGLE, "--data-cache-path", cache]))


PP2 = ["--pipeline-model-parallel-size", "2"]  # cut between the encoder and the decoder


@pytest.mark.parametrize("key, flags", [
    layout_case("t5", "tp2", (2,), TP2),
    layout_case("t5", "tp2-recompute-full", (2,), [*TP2, "--recompute-granularity", "full"]),
    layout_case("t5", "tp2-recompute-selective", (2,), [*TP2, "--recompute-granularity", "selective"]),
    layout_case("t5", "pp2", (2,), [*SINGLE, *PP2]),
    layout_case("t5", "tp2-pp2", (4,), [*TP2, *PP2]),
])  # fmt: skip
def test_t5_loss_parity(reference, shared_tmp, cache, key, flags, request):
    """10 steps of span corruption against one process (fp32, 1e-5): the relative position bias,
    the cross-attention's fused key-value projection, the tied head and the pipeline cut included."""
    tb = os.path.join(shared_tmp, f"tb-parity-{request.node.callspec.id}")
    losses = train_losses("t5", [*T5, *flags, "--data-cache-path", cache], tb)
    assert_parity(losses, reference(key), 1e-5)
