"""Megatron-style arguments: defaults, the embedded default, and contradictions caught up front."""

import json

import pytest
import transformers

from megatron_slapo.arguments.parser import EMBEDDED_DEFAULTS, parse_args
from megatron_slapo.arguments.validation import validate_args
from megatron_slapo.errors import ConfigError
from megatron_slapo.models.vocabulary import padded_vocab_size
from megatron_slapo.training.loop import pretrain

DATA = ["--data-path", "corpus_text_document", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
SIZES = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32"]
TRAIN = ["--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3"]


def args_for(*extra, world=2):
    args = parse_args("gpt", [*DATA, *SIZES, *TRAIN, *extra])
    validate_args(args, world)
    return args


def test_megatron_names_and_derived_values():
    args = args_for("--tensor-model-parallel-size", "2", "--global-batch-size", "8", "--lr-warmup-fraction", "0.1")
    assert args.data_parallel_size == 1 and args.max_position_embeddings == 32 and args.lr_decay_iters == 10
    assert args.make_vocab_size_divisible_by == 128 and args.engine == "megatron" and not args.embedded_data
    assert args_for().global_batch_size == 4  # micro batch x data-parallel size


@pytest.mark.parametrize(
    "extra, world, message",
    [
        (
            ["--global-batch-size", "6"],
            2,
            r"global batch size \(6\) is not divisible by micro batch size \(2\) x data-parallel size \(2\)",
        ),
        (["--tensor-model-parallel-size", "3"], 2, "world size 2 is not divisible by tensor \\(3\\)"),
        (["--pipeline-model-parallel-size", "2", "--engine", "ddp"], 2, "pipeline parallelism needs --engine megatron"),
        (
            ["--use-distributed-optimizer", "--engine", "fsdp"],
            2,
            "--use-distributed-optimizer needs --engine megatron, not fsdp",
        ),
        (["--sequence-parallel"], 2, "--sequence-parallel .* needs --tensor-model-parallel-size > 1"),
        (["--expert-model-parallel-size", "2"], 3, "must divide the data-parallel size, 3"),
        (["--expert-model-parallel-size", "2", "--engine", "fsdp"], 2, "needs --engine megatron or ddp"),
        (
            ["--expert-model-parallel-size", "2", "--ckpt-format", "torch", "--save", "x"],
            2,
            "saves with --ckpt-format torch_dist",
        ),
        (
            [
                "--expert-model-parallel-size",
                "2",
                "--expert-tensor-parallel-size",
                "1",
                "--tensor-model-parallel-size",
                "2",
            ],
            8,
            "needs --sequence-parallel: each tensor-parallel rank must route different tokens",
        ),
        (["--expert-tensor-parallel-size", "2"], 2, "split by their features over the tensor-parallel ranks"),
        (
            ["--accumulate-allreduce-grads-in-fp32", "--engine", "ddp"],
            1,
            "--accumulate-allreduce-grads-in-fp32 needs --engine megatron, not ddp",
        ),
        (["--grad-reduce-in-bf16"], 1, "--grad-reduce-in-bf16 needs --bf16"),
        (["--eval-interval", "0"], 1, "--eval-interval must be >= 1"),
        (["--min-lr", "1"], 1, "--min-lr 1.0 must not exceed --lr 0.001"),
        (["--bf16", "--fp16"], 1, "mutually exclusive"),
        (["--save-interval", "5"], 1, "--save-interval needs --save"),
        (["--finetune"], 1, "--finetune needs --load"),
        (["--seq-length", "64", "--max-position-embeddings", "32"], 1, "exceeds --max-position-embeddings"),
        (["--lr-warmup-iters", "10"], 1, "warmup .* must end before the decay"),
        (["--zero-stage", "3"], 2, "--zero-stage and --deepspeed-config need --engine deepspeed, not megatron"),
        (
            ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
            2,
            r"interleaved schedule needs a multiple of --pipeline-model-parallel-size \(2\) micro-batches per step; "
            "global batch size 2 gives 1",
        ),
    ],
)
def test_contradictions_are_one_clear_error(extra, world, message):
    with pytest.raises(ConfigError, match=message):
        args_for(*extra, world=world)


def test_every_problem_that_waits_on_no_other_is_in_one_message():
    """Missing flags, values out of range and contradicting pairs together; how values relate (the
    world and the parallel sizes, the width and the heads) once each is given and in range, so that
    no message is the consequence of another."""
    argv = [*DATA, *SIZES, "--micro-batch-size", "0", "--seed", "-1", "--lr", "nan", "--bf16", "--fp16",
            "--tensor-model-parallel-size", "3", "--hidden-size", "66"]  # fmt: skip
    with pytest.raises(ConfigError) as error:
        validate_args(parse_args("gpt", argv), 2)
    assert str(error.value) == (
        "--train-iters (or --train-samples) is required; --lr nan must be a finite number; --micro-batch-size 0 must "
        "be >= 1; --seed -1 must lie between 0 and 4294967295; --bf16 and --fp16 are mutually exclusive"
    )
    fixed = [*DATA, *SIZES, *TRAIN, "--tensor-model-parallel-size", "3", "--hidden-size", "66", "--bf16", "--fp16"]
    with pytest.raises(ConfigError) as error:
        validate_args(parse_args("gpt", fixed), 2)
    assert str(error.value) == ("world size 2 is not divisible by tensor (3) x pipeline (1) parallel sizes; "
                                "--hidden-size 66 is not divisible by --num-attention-heads 4: each head takes an "
                                "equal slice of the width; --bf16 and --fp16 are mutually exclusive")  # fmt: skip


def test_no_data_flags_means_the_embedded_default():
    args = parse_args("gpt", ["--schedule", "gpt_tp", "--train-iters", "7"])
    assert args.embedded_data and args.train_iters == 7  # an explicit flag wins
    assert args.num_layers == EMBEDDED_DEFAULTS["num_layers"]
    with pytest.raises(ConfigError, match="tokenizer flags need --data-path"):
        validate_args(parse_args("gpt", ["--tokenizer-type", "NullTokenizer"]), 1)


def test_vocab_padding_like_megatron():
    assert padded_vocab_size(50257, 128, 1) == 50304
    assert padded_vocab_size(50257, 128, 2) == 50432
    assert padded_vocab_size(4096, 128, 2) == 4096


def test_schedule_list(capsys):
    assert pretrain("gpt", ["--schedule", "list"]) is None
    out = capsys.readouterr().out
    assert "gpt_tp" in out and "bert_tp" in out and "llama_tp" in out
    from schedules import auto

    assert f"auto          {len(auto.MODEL_TYPES)} families" in out and len(auto.MODEL_TYPES) >= 45
    listed = {f.strip() for line in out.splitlines() if line.startswith(" " * 14) for f in line.split(",") if f.strip()}
    most_named = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "olmo3",
                  "glm4", "deepseek_v3"}  # fmt: skip
    assert most_named <= listed == set(auto.MODEL_TYPES), most_named - listed


def _deepspeed_config(tmp_path, config, *extra):
    from megatron_slapo.engines.deepspeed_zero import deepspeed_config

    path = tmp_path / "ds.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    args = args_for("--engine", "deepspeed", "--deepspeed-config", str(path), "--global-batch-size", "8", *extra)
    return deepspeed_config(args, dp_size=2)


def test_deepspeed_config_is_completed_from_the_flags(tmp_path):
    config = _deepspeed_config(tmp_path, {"zero_optimization": {"stage": 2, "overlap_comm": True}})
    assert config["zero_optimization"] == {"stage": 2, "overlap_comm": True}
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"]) == (8, 2)
    assert config["gradient_accumulation_steps"] == 2 and config["gradient_clipping"] == 1.0
    assert _deepspeed_config(tmp_path, {}, "--clip-grad", "0")["gradient_clipping"] == 0.0
    assert _deepspeed_config(tmp_path, {}, "--zero-stage", "3")["zero_optimization"]["stage"] == 3
    assert _deepspeed_config(tmp_path, {})["zero_optimization"]["stage"] == 1
    fp16 = _deepspeed_config(tmp_path, {}, "--fp16", "--initial-loss-scale", "1024")["fp16"]
    assert fp16 == {"enabled": True, "loss_scale": 0, "initial_scale_power": 10, "loss_scale_window": 1000,
                    "hysteresis": 2, "min_loss_scale": 1.0}  # fmt: skip
    assert _deepspeed_config(tmp_path, {}, "--bf16")["bf16"] == {"enabled": True}


@pytest.mark.parametrize(
    "config, extra, message",
    [
        ("{not json", [], "cannot read --deepspeed-config"),
        ({"optimizer": {"type": "Adam"}}, [], "the optimizer comes from the Megatron flags"),
        ({"zero_optimization": {"stage": 2}}, ["--zero-stage", "3"], "--zero-stage 3 contradicts stage 2"),
        ({"train_micro_batch_size_per_gpu": 4}, [], "train_micro_batch_size_per_gpu=4, but the batch flags give 2"),
        ({"bf16": {"enabled": True}}, [], "bf16 enabled=True; pass --bf16"),
        ({"fp16": {"enabled": False}}, ["--fp16"], "fp16 enabled=False, but --fp16 is given"),
        ({"gradient_clipping": 0.5}, [], r"gradient_clipping=0.5, but --clip-grad is 1.0; pass --clip-grad 0.5"),
    ],
)
def test_deepspeed_config_contradictions(tmp_path, config, extra, message):
    with pytest.raises(ConfigError, match=message):
        _deepspeed_config(tmp_path, config, *extra)


def test_an_hf_model_keeps_its_rows_when_they_cover_the_tokenizer_and_split_across_tp():
    from megatron_slapo.models.vocabulary import hf_vocab_size

    assert hf_vocab_size(151936, 151643, 128, 2) == 151936  # larger than the padded tokenizer, even: kept
    assert hf_vocab_size(151936, 151936, 128, 2) == 152064  # the tokenizer's own padding is larger
    assert hf_vocab_size(100, 500, 128, 2) == 512  # the tokenizer needs more rows than the model has
    assert hf_vocab_size(1001, 10, 128, 2) == 1024  # odd rows do not split over 2 ranks: Megatron's padding


SAMPLE_BASED = [*DATA, *SIZES, "--micro-batch-size", "2", "--lr", "1e-3"]  # no --train-iters


def samples_args(*extra, world=2):
    args = parse_args("gpt", [*SAMPLE_BASED, *extra])
    validate_args(args, world)
    return args


def test_train_samples_set_the_iterations_and_the_lr_schedule_runs_in_samples():
    import torch

    from megatron_slapo.engines.optimizer import build_scheduler

    args = samples_args("--train-samples", "43", "--lr-warmup-samples", "6", "--lr-decay-samples", "30",
                        "--lr-decay-style", "linear")  # fmt: skip
    assert args.global_batch_size == 4 and args.train_iters == 10  # 43 // 4, as Megatron: the rest is not trained
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    scheduler = build_scheduler(optimizer, args)
    lrs = []
    for _ in range(9):
        scheduler.step(increment=args.global_batch_size)
        lrs.append(optimizer.param_groups[0]["lr"])
    assert abs(lrs[0] - 1e-3 * 4 / 6) < 1e-12  # 4 of 6 warmup samples
    assert abs(lrs[1] - 1e-3 * (1 - (8 - 6) / (30 - 6))) < 1e-12  # linear decay over samples 6..30
    assert lrs[7] == lrs[8] == 0.0  # decayed to --min-lr after 30 samples
    defaults = samples_args("--train-samples", "40", "--lr-warmup-fraction", "0.25")
    assert defaults.lr_decay_samples == 40 and build_scheduler(optimizer, defaults).lr_warmup_steps == 10


def test_embedded_run_takes_train_samples_instead_of_its_default_iterations():
    args = parse_args("gpt", ["--train-samples", "64"])
    validate_args(args, 1)
    assert args.train_iters == 64 // EMBEDDED_DEFAULTS["global_batch_size"]
    assert "train_iters" not in args.embedded_defaults
    args = parse_args("gpt", ["--train-samples", "64", "--lr-warmup-samples", "8"])
    validate_args(args, 1)  # the embedded --lr-warmup-fraction gives way: no "not both" for a flag not given
    assert args.lr_warmup_fraction is None and args.lr_warmup_samples == 8


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--train-samples", "40", "--train-iters", "10"], "--train-iters and --train-samples are mutually exclusive"),
        (["--train-samples", "40", "--lr-decay-iters", "5"], "with --train-samples give --lr-decay-samples"),
        (["--train-samples", "40", "--lr-warmup-iters", "2"], "with --train-samples give --lr-decay-samples"),
        (["--train-iters", "10", "--lr-warmup-samples", "8"], "--lr-warmup-samples need --train-samples"),
        (["--train-iters", "10", "--lr-decay-samples", "8"], "--lr-decay-samples / --lr-warmup-samples need"),
        (["--train-samples", "40", "--lr-warmup-samples", "8", "--lr-warmup-fraction", "0.1"], "not both"),
        (["--train-samples", "3"], r"--train-samples 3 is less than one global batch \(4 samples\)"),
        (["--train-samples", "40", "--lr-warmup-samples", "40"], r"warmup \(40 samples\) must end before the decay"),
        (["--train-samples", "0"], "--train-samples 0 must be >= 1"),
        (["--train-iters", "10", "--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes 0 must be >= 1"),
        (["--train-iters", "10", "--loss-scale-window", "0"], "--loss-scale-window 0 must be >= 1"),
        (["--train-iters", "10", "--hysteresis", "0"], "--hysteresis 0 must be >= 1"),
        (["--train-iters", "10", "--min-loss-scale", "0"], "--min-loss-scale 0 must be > 0"),
        (["--train-iters", "10", "--fp16", "--initial-loss-scale", "64", "--min-loss-scale", "128"],
         "--min-loss-scale 128 exceeds --initial-loss-scale 64"),
        (["--train-iters", "10", "--exit-duration-in-mins", "0"], "--exit-duration-in-mins 0 must be > 0"),
        (["--train-iters", "10", "--pipeline-model-parallel-size", "2", "--reset-attention-mask"],
         "--reset-attention-mask cannot run with --pipeline-model-parallel-size > 1 yet"),
    ],
)  # fmt: skip
def test_trainer_flag_contradictions_are_one_clear_error(extra, message):
    with pytest.raises(ConfigError, match=message):
        samples_args(*extra)


def test_loss_scale_flags_drive_the_dynamic_scaler():
    from megatron_slapo.engines.loss_scaler import loss_scaler_for

    scaler = loss_scaler_for(args_for("--fp16", "--initial-loss-scale", "1024", "--loss-scale-window", "3",
                                      "--hysteresis", "2", "--min-loss-scale", "256"))  # fmt: skip
    scales = []
    for overflow in [False] * 3 + [True] * 5:
        scaler.update(overflow)
        scales.append(float(scaler.scale))
    # grows after 3 clean steps; the 1st overflow is tolerated (hysteresis 2), then halves down to the minimum
    assert scales == [1024, 1024, 2048, 2048, 1024, 512, 256, 256]
    static = loss_scaler_for(args_for("--fp16", "--loss-scale", "8", "--loss-scale-window", "1"))
    static.update(True)
    assert float(static.scale) == 8


def test_deepspeed_fp16_config_takes_the_loss_scale_flags(tmp_path):
    fp16 = _deepspeed_config(tmp_path, {}, "--fp16", "--initial-loss-scale", "1024", "--loss-scale-window", "50",
                             "--hysteresis", "3", "--min-loss-scale", "4")["fp16"]  # fmt: skip
    assert (fp16["loss_scale_window"], fp16["hysteresis"], fp16["min_loss_scale"]) == (50, 3, 4.0)


def test_the_arguments_are_printed_as_megatron_does(capsys):
    from megatron_slapo.arguments.trainer_args import print_arguments

    print_arguments(args_for("--seed", "7"))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "------------------------ arguments ------------------------"
    assert lines[-1] == "-------------------- end of arguments ---------------------"
    assert f"  seed {'.' * 44} 7" in lines and f"  micro_batch_size {'.' * 32} 2" in lines
    body = lines[1:-1]
    assert body == sorted(body, key=str.lower) and len(body) > 50


def _config(*extra):
    from megatron_slapo.data.tokenizers import build_tokenizer
    from megatron_slapo.training.model import build_config

    args = args_for(*extra, world=1)
    return build_config(args, build_tokenizer("NullTokenizer", None, None, None, 100))


def test_moe_flags_shape_the_experts_of_an_moe_family():
    config = _config("--model-type", "qwen3_moe", "--num-experts", "4", "--moe-router-topk", "2")
    # each expert 4h x 768/6144 wide, as qwen3_moe's experts are to its FFN
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (4, 2, 32)
    config = _config("--model-type", "qwen2_moe", "--num-experts", "2", "--moe-ffn-hidden-size", "48")
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (2, 2, 48)  # top-k <= 2
    assert config.shared_expert_intermediate_size == 256  # as wide as its FFN, as in qwen2_moe
    config = _config("--model-type", "qwen2_moe", "--num-experts", "2", "--moe-shared-expert-intermediate-size", "40")
    assert config.shared_expert_intermediate_size == 40 and config.moe_intermediate_size == 256 // 4  # the flag's
    config = _config("--model-type", "mixtral", "--num-experts", "6", "--ffn-hidden-size", "96")
    assert (config.num_local_experts, config.intermediate_size) == (6, 96)  # its experts are the FFN


def test_a_family_default_padding_id_is_dropped():
    assert transformers.SmolLM3Config().pad_token_id is not None  # 128004: beyond a small vocabulary
    assert _config("--model-type", "smollm3").pad_token_id is None


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--model-type", "llama", "--num-experts", "4"], "--num-experts shapes the experts of an MoE --model-type"),
        (["--hf-config", "gpt2", "--moe-router-topk", "2"], "--moe-router-topk shapes the experts"),
        (["--model-type", "qwen3", "--num-experts", "4"], "the qwen3 config has no num_local_experts or num_experts"),
        (["--model-type", "mixtral", "--num-experts", "4", "--moe-ffn-hidden-size", "32"],
         r"no moe_intermediate_size to take it \(its experts are --ffn-hidden-size wide\)"),
        (["--model-type", "qwen3_moe"], "qwen3_moe is a mixture of experts: give --num-experts .the family's 128"),
        (["--model-type", "mixtral", "--num-experts", "2", "--moe-router-topk", "3"], "topk 3 exceeds --num-experts 2"),
    ],
)  # fmt: skip
def test_moe_flags_for_a_model_without_such_experts_are_refused(extra, message):
    with pytest.raises(ConfigError, match=message):
        _config(*extra)


def test_without_schedule_a_family_auto_is_verified_on_gets_auto_under_tensor_parallelism():
    from schedules import default_for

    assert default_for("qwen3", 2) == default_for("mixtral", 4) == "auto"  # verified, nothing written by hand
    assert default_for("qwen3", 1) == "default"  # no tensor parallelism: nothing to split
    assert (default_for("llama", 2), default_for("gpt2", 2)) == ("llama_tp", "gpt_tp")  # a schedule of their own
    assert default_for("codegen", 2) == "default"  # auto is not verified on it
