"""Every engine trains the same model as one plain process: loss parity over 10 fp32 steps.

The reference is ``pretrain_{gpt,bert}.py`` run as a single process (no torchrun) with the same
global batch; each layout below must reproduce its losses to 1e-5. Only the order of floating-point
reductions differs between layouts (data-parallel averaging, tensor-parallel partial sums, ZeRO's
reduce-scatter), which moves fp32 losses around 8.0 by a few 1e-7; dropout is off because its
masks depend on the layout.
"""

import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
import transformers

from megatron_slapo.checkpoints import checkpoint_files, checkpointing
from megatron_slapo.engines.optimizer import local_part
from tests.distributed.runs import (
    PARITY,
    assert_parity,
    layout_case,
    reference_losses,
    train_losses,
)
from tests.utils import require_compiler

TOLERANCE = 1e-5
SCHEDULES = {"gpt": ["--schedule", "gpt_tp"], "bert": ["--schedule", "bert_tp"]}
ENCODERS = {name: ["--model-type", name, "--schedule", "bert_tp"] for name in ("albert", "roberta")}
TP2 = ["--tensor-model-parallel-size", "2"]
ZERO = ["--engine", "deepspeed", "--zero-stage"]
MEGATRON = ["--engine", "megatron"]
PP2 = ["--pipeline-model-parallel-size", "2"]
FULL = ["--recompute-granularity", "full"]
MODEL = [*PARITY, "--num-layers", "4"]  # 4 layers: 2 pipeline ranks x 2 virtual stages of one layer
SAVED_AT = 5  # the GPT reference saves this iteration: resumed at other layouts, exported

LAYOUTS = {  # name -> (world sizes, extra flags)
    "tp2": ((2,), TP2),
    "zero1-dp2": ((2,), [*ZERO, "1"]),
    "zero2-dp2": ((2,), [*ZERO, "2"]),
    "zero3-dp2": ((2,), [*ZERO, "3"]),
    "zero3-tp2-dp2": ((4,), [*ZERO, "3", *TP2]),
    "fsdp-dp2": ((2,), ["--engine", "fsdp"]),
    "fsdp-tp2-dp2": ((4,), ["--engine", "fsdp", *TP2]),
    "megatron-tp2": ((2,), [*MEGATRON, *TP2]),
    "megatron-dp2-distopt-overlap": ((2,), [*MEGATRON, "--use-distributed-optimizer", "--overlap-grad-reduce"]),
    "pp2-1f1b": ((2,), [*MEGATRON, *PP2]),
    "pp2-vpp2-interleaved": ((2,), [*MEGATRON, *PP2, "--num-layers-per-virtual-pipeline-stage", "1"]),
    "tp2-pp2": ((4,), [*MEGATRON, *TP2, *PP2]),
    "pp2-dp2": ((4,), [*MEGATRON, *PP2]),
    # Tied embeddings: the reduce-scatter leaves each rank its shard; the tie's all-reduce must add like shards.
    "pp2-dp2-distopt": ((4,), [*MEGATRON, *PP2, "--use-distributed-optimizer"]),
    # Activation recomputation, Megatron's way (per stage) and Slapo's ratio: the same losses.
    "tp2-sp": ((2,), [*MEGATRON, *TP2, "--sequence-parallel"]),
    "tp2-sp-ddp": ((2,), ["--engine", "ddp", *TP2, "--sequence-parallel"]),
    # DeepSpeed sums the sequence-parallel gradients in autograd hooks, FSDP2 its shards after the backward
    "zero2-tp2-sp-dp2": ((4,), [*ZERO, "2", *TP2, "--sequence-parallel"]),
    "zero3-tp2-sp": ((2,), [*ZERO, "3", *TP2, "--sequence-parallel"]),
    "fsdp-tp2-sp-dp2": ((4,), ["--engine", "fsdp", *TP2, "--sequence-parallel"]),
    "tp2-pp2-sp": ((4,), [*MEGATRON, *TP2, *PP2, "--sequence-parallel"]),
    "tp2-recompute-full": ((2,), [*TP2, *FULL]),
    "tp2-recompute-selective": ((2,), [*TP2, "--recompute-granularity", "selective"]),
    "pp2-recompute-block": ((2,), [*MEGATRON, *PP2, *FULL, "--recompute-method", "block"]),  # layers 0 and 2
    "tp2-pp2-checkpoint-ratio": ((4,), [*MEGATRON, *TP2, *PP2, "--checkpoint-ratio", "0.5"]),
    # torch.compile per layer, around the tensor-parallel collectives and inside recompute
    "tp2-compile-recompute-full": ((2,), [*TP2, "--compile", *FULL]),
    "tp2-sp-compile-ddp": ((2,), ["--engine", "ddp", *TP2, "--sequence-parallel", "--compile"]),
}


def _reference_checkpoint(shared_tmp: str) -> str:
    return os.path.join(shared_tmp, "ck-reference-gpt")


@pytest.fixture(scope="module")
def reference(shared_tmp, cache):
    """Single-process losses per task (and for ALBERT and RoBERTa), run in one process. GPT's run
    saves its iteration 5 (torch_dist), which the reshard cases resume and the export cases convert."""
    runs = {**SCHEDULES, **ENCODERS}
    saving = ["--save", _reference_checkpoint(shared_tmp), "--save-interval", str(SAVED_AT)]
    return reference_losses(shared_tmp, lambda key: ("gpt" if key == "gpt" else "bert",
                                                     [*MODEL, *runs[key], "--data-cache-path", cache,
                                                      *(saving if key == "gpt" else [])]), runs)  # fmt: skip


# torch.compile per layer under the sharded engines (their gathers and hooks stay outside the compiled
# code): GPT only, the compiled code being the same for BERT's layers
COMPILED = {
    "fsdp-tp2-dp2-compile": ((4,), ["--engine", "fsdp", *TP2, "--compile"]),
    "zero2-dp2-compile": ((2,), [*ZERO, "2", "--compile"]),
    "zero3-dp2-compile": ((2,), [*ZERO, "3", "--compile"]),
}
# The slowest compiled cases run in the slow tier (the README's suite stays within 20 minutes): BERT's
# (GPT's compile the same code) and FSDP2's at four ranks
SLOW = {("bert", "tp2-compile-recompute-full"), ("bert", "tp2-sp-compile-ddp"), ("gpt", "tp2-sp-compile-ddp"),
        ("gpt", "fsdp-tp2-dp2-compile"), ("gpt", "zero3-dp2-compile"), ("gpt", "tp2-compile-recompute-full")}  # fmt: skip


def _case(task: str, name: str, sizes: tuple, flags: list[str]) -> pytest.param:
    return layout_case(task, name, sizes, flags, slow=(task, name) in SLOW)


CASES = [*(_case(task, name, sizes, flags) for name, (sizes, flags) in LAYOUTS.items() for task in SCHEDULES),
         *(_case("gpt", name, sizes, flags) for name, (sizes, flags) in COMPILED.items())]  # fmt: skip


@pytest.mark.parametrize("task, flags", CASES)
def test_loss_parity_with_one_process(task, flags, reference, shared_tmp, cache, request):
    if "--compile" in flags:
        require_compiler()
    expected = reference(task)
    tb = os.path.join(shared_tmp, f"tb-parity-{request.node.callspec.id}")
    losses = train_losses(task, [*MODEL, *SCHEDULES[task], *flags, "--data-cache-path", cache], tb)
    assert_parity(losses, expected, TOLERANCE)


@pytest.mark.parametrize("encoder, flags", [
    pytest.param("albert", [], id="albert-tp2"),
    pytest.param("albert", FULL, id="albert-tp2-recompute-full"),
    pytest.param("albert", ["--recompute-granularity", "selective"], id="albert-tp2-recompute-selective"),
    pytest.param("roberta", [], id="roberta-tp2"),
    pytest.param("roberta", ["--sequence-parallel"], id="roberta-tp2-sp"),
])  # fmt: skip
def test_encoder_loss_parity(reference, shared_tmp, cache, encoder, flags, request):
    """bert_tp on ALBERT (its one shared layer sharded once and run, and recomputed, at every
    depth; its factorised embedding tied to the decoder) and on RoBERTa (masked LM only, positions
    offset by the padding id): the same losses as one process."""
    tb = os.path.join(shared_tmp, f"tb-parity-{request.node.callspec.id}")
    losses = train_losses("bert", [*MODEL, *ENCODERS[encoder], *TP2, *flags, "--data-cache-path", cache], tb)
    assert_parity(losses, reference(encoder), TOLERANCE)


def test_gpt_fused_loss_parity(reference, shared_tmp, cache):
    """gpt_fused (one kernel per GeLU, every layer compiled) on two data-parallel ranks: the same
    losses as one eager process."""
    require_compiler()
    tb = os.path.join(shared_tmp, "tb-parity-gpt-fused")
    losses = train_losses("gpt", [*MODEL, "--schedule", "gpt_fused", "--data-cache-path", cache], tb)
    assert_parity(losses, reference("gpt"), TOLERANCE)


@pytest.mark.parametrize("engine", ["megatron", "ddp"])
def test_compiled_layers_draw_the_dropout_masks_eager_draws_under_tp2(engine, shared_tmp, cache):
    """--compile with dropout on (0.1 on the hidden states and the attention probabilities) at TP2:
    the losses of eager, step by step, to 1e-5; the compiled run recomputes every layer too. A mask
    drawn otherwise (inductor's own RNG, another tensor-parallel stream, a replay that draws anew)
    moves the loss by ~1e-2; without dropout the first loss is another (the flags did apply)."""
    require_compiler()
    run = [*PARITY, *SCHEDULES["gpt"], *TP2, "--engine", engine, "--train-iters", "3", "--data-cache-path", cache]
    tb = os.path.join(shared_tmp, f"tb-compile-dropout-{engine}")
    dropout = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    eager = train_losses("gpt", [*run, *dropout], f"{tb}/eager")
    compiled = train_losses("gpt", [*run, *dropout, "--compile", "--recompute-granularity", "full"], f"{tb}/compiled")
    plain = train_losses("gpt", [*run, "--train-iters", "1"], f"{tb}/no-dropout")
    assert sorted(eager) == sorted(compiled) == [1, 2, 3], (eager, compiled)
    assert max(abs(eager[i] - compiled[i]) for i in eager) < TOLERANCE, (eager, compiled)
    assert abs(plain[1] - eager[1]) > 1e-3, (plain, eager)


def test_zero0_from_a_deepspeed_config_trains_as_one_process(reference, shared_tmp, cache, monkeypatch):
    """--deepspeed-config in a real run: a JSON file asking for ZeRO stage 0 (no --zero-stage; the
    flags alone would give stage 1), which DeepSpeed itself then reports running, on two data-parallel
    ranks; and ZeRO-0's losses are one process's."""
    from megatron_slapo.engines.deepspeed_zero import DeepSpeedEngine

    config = os.path.join(shared_tmp, "ds-zero0.json")
    if dist.get_rank() == 0:
        with open(config, "w") as f:
            json.dump({"zero_optimization": {"stage": 0}}, f)
    dist.barrier()
    stages, train_step = [], DeepSpeedEngine.train_step

    def recording(self, *args, **kwargs):
        stages.append(self.ds.zero_optimization_stage())  # DeepSpeed's reading of the config it was given
        return train_step(self, *args, **kwargs)

    monkeypatch.setattr(DeepSpeedEngine, "train_step", recording)
    tb = os.path.join(shared_tmp, "tb-parity-zero0-config")
    losses = train_losses("gpt", [*MODEL, *SCHEDULES["gpt"], "--engine", "deepspeed", "--deepspeed-config", config,
                                  "--data-cache-path", cache], tb)  # fmt: skip
    assert stages == [0] * 10, stages
    assert_parity(losses, reference("gpt"), TOLERANCE)


# The one-process GPT reference's iteration 5 (weights, Adam's moments and step count, the LR schedule)
# resumed at another layout and engine: each reads its part of every tensor out of the saved whole ones
RESHARDS = {
    "tp2": ((2,), [*MEGATRON, *TP2]),  # split by TP: strided q|k|v, vocabulary-parallel rows, and their moments
    "zero3-dp2": ((2,), [*ZERO, "3"]),  # DeepSpeed's partitions
    "fsdp-dp2": ((2,), ["--engine", "fsdp"]),  # FSDP2's rows
    "tp2-dp2-distopt": ((4,), [*MEGATRON, *TP2, "--use-distributed-optimizer"]),  # megatron-core's flat ranges
}


@pytest.mark.parametrize("flags", [pytest.param(flags, id=name, marks=pytest.mark.world_sizes(*sizes))
                                   for name, (sizes, flags) in RESHARDS.items()])  # fmt: skip
def test_a_one_process_checkpoint_resumes_at_another_layout_with_its_optimizer_state(flags, reference, shared_tmp,
                                                                                      cache, request):  # fmt: skip
    """One process's torch_dist checkpoint of iteration 5, loaded at this layout: iterations 6-10 give
    the uninterrupted run's losses to 1e-5. A moment, the step count or the LR schedule not restored
    (or read into the wrong elements) moves them by far more."""
    expected = reference("gpt")  # the reference saved its checkpoint too
    case = request.node.callspec.id
    ck = os.path.join(shared_tmp, f"ck-reshard-{case}")
    if dist.get_rank() == 0:  # iteration 5 alone (the reference saved 10 too)
        saved = _reference_checkpoint(shared_tmp)
        shutil.copytree(checkpointing.iteration_dir(saved, SAVED_AT), checkpointing.iteration_dir(ck, SAVED_AT))
        with open(os.path.join(ck, checkpoint_files.LATEST), "w") as f:
            f.write(str(SAVED_AT))
    dist.barrier()
    tb = os.path.join(shared_tmp, f"tb-reshard-{case}")
    resumed = train_losses("gpt", [*MODEL, *SCHEDULES["gpt"], *flags, "--load", ck, "--data-cache-path", cache], tb)
    assert sorted(resumed) == list(range(SAVED_AT + 1, 11)), resumed
    worst = max(abs(resumed[i] - expected[i]) for i in resumed)
    assert worst < TOLERANCE, (worst, resumed, expected)


def _setup(argv: list[str]):
    from megatron_slapo.arguments.parser import parse_args
    from megatron_slapo.training.run import setup

    return setup(parse_args("gpt", argv))


@pytest.mark.parametrize("engine", [[*ZERO, "3"], ["--engine", "fsdp"]], ids=["zero3", "fsdp"])
def test_sharded_engines_hold_half_the_parameters_per_rank(engine, cache, capsys):
    run = _setup([*PARITY, *engine, "--data-cache-path", cache])
    params = list(run.engine.model.parameters())
    full = sum(getattr(p, "ds_numel", p.numel()) for p in params) * 4  # ZeRO-3 and DTensors know the full size
    local = sum(local_part(p).numel() for p in params) * 4
    report = run.engine.memory_report()
    assert report["params"] == local
    assert abs(local - full / 2) <= 0.05 * full / 2, (local, full)
    out = capsys.readouterr().out
    if dist.get_rank() == 0:
        assert "rank 1 (tensor, pipeline, data) = (0, 0, 1): parameters" in out, out


def test_tp2_sharded_layers_hold_half_their_parameters(shared_tmp, cache):
    """Against the plain HF model of the same config: each tensor the schedule shards holds half of
    it on each rank (attention, MLP and the vocabulary-parallel embedding), the rest all of it."""
    import json

    run = _setup([*PARITY, *SCHEDULES["gpt"], *TP2, "--data-cache-path", cache])
    local = run.engine.state_dict(os.path.join(shared_tmp, "tp2-half"), include_optimizer=False)["model"]
    with torch.device("meta"):
        plain = transformers.GPT2LMHeadModel(transformers.GPT2Config(**json.loads(run.metadata["hf_config"])))
    full = plain.state_dict()
    shards = run.metadata["shards"]
    assert {n for n in full if n.endswith(".weight") and ".mlp." in n} <= set(shards)
    for name, value in full.items():
        assert local[name].numel() * (2 if name in shards else 1) == value.numel(), name
    sharded = sum(full[n].numel() for n in shards)
    assert sharded > 0.8 * sum(p.numel() for p in plain.parameters())  # the bulk of the model is split
    assert run.engine.memory_report()["params"] == 4 * sum(p.numel() for p in run.engine.model.parameters())


def test_zero3_checkpoint_exports_deepspeeds_own_fp32_weights(shared_tmp, cache):
    """The gathered weights in model_optim_rng.pt, exported to HF, equal what DeepSpeed's
    zero_to_fp32 consolidates from its ZeRO partitions (an independent reading of the same files)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from megatron_slapo.training.loop import pretrain
    from tools import convert_checkpoint

    ck, hf = os.path.join(shared_tmp, "ck-zero3-export"), os.path.join(shared_tmp, "hf-zero3-export")
    pretrain("gpt", [*PARITY, "--train-iters", "3", *ZERO, "3", "--save", ck, "--data-cache-path", cache,
                     "--ckpt-format", "torch"])  # fmt: skip
    if dist.get_rank() == 0:
        convert_checkpoint.main(["to-hf", "--load", ck, "--save-hf", hf])
    dist.barrier()
    exported = transformers.AutoModelForCausalLM.from_pretrained(hf).state_dict()
    consolidated = get_fp32_state_dict_from_zero_checkpoint(checkpointing.iteration_dir(ck, 3), tag="deepspeed")
    vocab = exported["transformer.wte.weight"].size(0)  # export drops the vocabulary padding
    assert set(consolidated) <= set(exported)
    for name, value in consolidated.items():
        assert torch.equal(exported[name], value[:vocab] if value.size(0) > vocab else value), name


@pytest.mark.parametrize(
    "flags",
    [pytest.param(PP2, id="pp2"), pytest.param([*PP2, *TP2], id="tp2-pp2", marks=pytest.mark.world_sizes(4))],
)
def test_pipeline_checkpoint_exports_the_model_one_process_trains(flags, reference, shared_tmp, cache, request):
    """Per-stage files (mp_rank_XX_YYY), merged by the converter, give the HF model that one plain
    process trains with the same data (the GPT reference's iteration 5). Compared by their logits:
    after a few AdamW steps single weights can differ by ~2e-5 (Adam's m / sqrt(v) turns fp32
    reduction-order noise in near-zero gradients into lr-sized steps), while the models agree to
    5e-5 on logits of magnitude ~1."""
    from megatron_slapo.training.loop import pretrain
    from tools import convert_checkpoint

    reference("gpt")  # which saved its iteration 5 (torch_dist)
    name = request.node.callspec.id
    run = [*MODEL, *SCHEDULES["gpt"], "--data-cache-path", cache, "--exit-interval", str(SAVED_AT)]
    ck, ref = os.path.join(shared_tmp, f"ck-export-{name}"), _reference_checkpoint(shared_tmp)
    pretrain("gpt", [*run, *flags, "--save", ck, "--ckpt-format", "torch"])
    worst = None
    if dist.get_rank() == 0:
        convert_checkpoint.main(["to-hf", "--load", ck, "--save-hf", ck + "-hf"])
        convert_checkpoint.main(["to-hf", "--load", ref, "--iteration", str(SAVED_AT), "--save-hf", ck + "-ref-hf"])
        a = transformers.AutoModelForCausalLM.from_pretrained(ck + "-hf").eval()
        b = transformers.AutoModelForCausalLM.from_pretrained(ck + "-ref-hf").eval()
        assert a.state_dict().keys() == b.state_dict().keys()
        ids = torch.randint(0, a.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            worst = (a(ids).logits - b(ids).logits).abs().max().item()
    box = [worst]
    dist.broadcast_object_list(box, src=0)
    assert box[0] < 5e-5, box[0]


def test_zero3_partitions_each_unit_as_it_is_built_with_hf_initialisation():
    """``build`` hands each unit to ZeRO-3 as soon as it is initialised: no rank holds more than one
    unit in full, and the gathered weights are exactly those of a plain build with the same seed."""
    import deepspeed
    from megatron.core import parallel_state

    import megatron_slapo as ms
    from megatron_slapo import parallel
    from megatron_slapo.arguments.parser import parse_args
    from megatron_slapo.arguments.validation import validate_args
    from megatron_slapo.engines.deepspeed_zero import DeepSpeedEngine
    from tests.utils import tiny_gpt2_config

    args = parse_args("gpt", [*PARITY, *ZERO, "3", "--mock-data", "--tokenizer-type", "NullTokenizer",
                              "--vocab-size", "100", "--lr", "1e-3"])  # fmt: skip
    validate_args(args, dist.get_world_size())
    parallel.initialize(1, timeout_minutes=3)
    config = tiny_gpt2_config(n_layer=4, vocab_size=512)
    plain = ms.build(ms.create_schedule(_meta_gpt2(config)), seed=3)
    model = _meta_gpt2(config)
    dp_group = parallel_state.get_data_parallel_group()
    partition = DeepSpeedEngine.build_hook(args, dp_group, parallel.tensor_parallel_group())
    held = []

    def watch(modules):
        held.append(sum(p.numel() for p in model.parameters() if not p.is_meta and not hasattr(p, "ds_id")))
        partition(modules)

    ms.build(ms.create_schedule(model), seed=3, after_unit=watch)
    params = list(model.parameters())
    assert all(hasattr(p, "ds_id") for p in params)
    layer = sum(p.numel() for p in plain.transformer.h[0].parameters())
    rest = sum(p.numel() for n, p in plain.named_parameters() if ".h." not in n)  # embeddings, final norm
    assert max(held) <= max(layer, rest) < sum(p.numel() for p in plain.parameters())
    with deepspeed.zero.GatheredParameters(params):
        for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
            assert torch.equal(p.detach(), q.detach()), name


def _meta_gpt2(config):
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(config)
