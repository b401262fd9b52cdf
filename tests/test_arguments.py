"""Megatron-style arguments: defaults, the embedded default, and contradictions caught up front."""

import pytest

from megatron_slapo.errors import ConfigError
from megatron_slapo.training.arguments import EMBEDDED_DEFAULTS, parse_args, validate_args
from megatron_slapo.training.loop import pretrain
from megatron_slapo.training.model import padded_vocab_size

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
    assert args.make_vocab_size_divisible_by == 128 and args.engine == "ddp" and not args.embedded_data
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
        (["--pipeline-model-parallel-size", "2"], 2, "needs a pipeline engine"),
        (["--use-distributed-optimizer"], 2, "needs megatron-core's engine"),
        (["--sequence-parallel"], 2, "no schedule in schedules/ applies sequence parallelism"),
        (["--eval-interval", "0"], 1, "--eval-interval must be >= 1"),
        (["--min-lr", "1"], 1, "--min-lr 1.0 must lie between 0 and --lr 0.001"),
        (["--bf16", "--fp16"], 1, "mutually exclusive"),
        (["--save-interval", "5"], 1, "--save-interval needs --save"),
        (["--finetune"], 1, "--finetune needs --load"),
        (["--seq-length", "64", "--max-position-embeddings", "32"], 1, "exceeds --max-position-embeddings"),
        (["--lr-warmup-iters", "10"], 1, "warmup .* must end before the decay"),
    ],
)
def test_contradictions_are_one_clear_error(extra, world, message):
    with pytest.raises(ConfigError, match=message):
        args_for(*extra, world=world)


def test_no_data_flags_means_the_embedded_default():
    args = parse_args("gpt", ["--schedule", "gpt_tp", "--train-iters", "7"])
    assert args.embedded_data and args.train_iters == 7  # an explicit flag wins
    assert args.num_layers == EMBEDDED_DEFAULTS["num_layers"] and args.tensorboard_dir
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
