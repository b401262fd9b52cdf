"""The trainer's Megatron flags: sample-based training length, run control, loss scaling; the arguments dump.

:func:`resolve_training_length` turns ``--train-samples`` into iterations (Megatron-LM's
``train_samples // global_batch_size``, no batch-size ramp-up) before the rest of the validation
derives anything from ``--train-iters``; :func:`check_trainer_args` checks the remaining flags of
this group. The LR schedule runs in samples either way (:func:`lr_schedule_samples`), as in
Megatron-LM, so ``--lr-warmup-samples`` / ``--lr-decay-samples`` need not be multiples of the batch.
"""

from __future__ import annotations

import argparse
import os

from megatron_slapo.engines.optimizer import lr_schedule_samples
from megatron_slapo.errors import ConfigError

# The smallest allowed value of this group's flags, checked when given (with the others, by validate_args).
TRAINER_MINIMUM = dict(
    train_samples=1, lr_decay_samples=1, lr_warmup_samples=0, distributed_timeout_minutes=1, loss_scale_window=1,
    hysteresis=1,
)  # fmt: skip


def _name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def resolve_training_length(args: argparse.Namespace, data_parallel_size: int) -> None:
    """Check ``--train-iters`` against ``--train-samples`` and set ``args.train_iters`` from samples.

    Megatron-LM: the two are mutually exclusive; sample-based training takes its LR warmup and decay
    in samples (``--lr-warmup-samples``, ``--lr-decay-samples``), iteration-based training in
    iterations, and mixing the two is refused. Runs before the iteration-based derivations, once
    the flags are known to be in range and ``--micro-batch-size`` given.
    """
    if getattr(args, "train_samples", None) is None:
        if args.lr_decay_samples is not None or args.lr_warmup_samples:
            raise ConfigError("--lr-decay-samples / --lr-warmup-samples need --train-samples "
                              "(with --train-iters use --lr-decay-iters / --lr-warmup-iters)")  # fmt: skip
        return
    embedded = getattr(args, "embedded_defaults", {})
    if embedded.pop("train_iters", None) is not None:
        args.train_iters = None  # the embedded run's default length gives way to the user's --train-samples
    if args.lr_warmup_samples and embedded.pop("lr_warmup_fraction", None) is not None:
        args.lr_warmup_fraction = None  # ... and its default warmup to the user's --lr-warmup-samples
    if args.train_iters is not None:
        raise ConfigError("--train-iters and --train-samples are mutually exclusive: give one")
    if args.lr_decay_iters is not None or args.lr_warmup_iters:
        raise ConfigError("--lr-decay-iters / --lr-warmup-iters count iterations; with --train-samples give "
                          "--lr-decay-samples / --lr-warmup-samples")  # fmt: skip
    if args.lr_warmup_fraction is not None and args.lr_warmup_samples:
        raise ConfigError("give --lr-warmup-fraction or --lr-warmup-samples, not both")
    gbs = args.global_batch_size or args.micro_batch_size * data_parallel_size
    if args.train_samples < gbs:
        raise ConfigError(f"--train-samples {args.train_samples} is less than one global batch ({gbs} samples)")
    args.train_iters = args.train_samples // gbs


def check_trainer_args(args: argparse.Namespace) -> None:
    """Check this group's flags once the general validation has derived the batch sizes."""
    if args.train_samples is not None:
        if args.lr_decay_samples is None:
            args.lr_decay_samples = args.train_samples
        warmup, decay = lr_schedule_samples(args)[:2]
        if warmup >= decay:  # megatron-core's scheduler asserts this whatever the decay style
            raise ConfigError(f"LR warmup ({warmup:g} samples) must end before the decay does ({decay} samples)")
    documents = [f for f in ("reset_position_ids", "reset_attention_mask") if getattr(args, f, False)]
    if documents and args.pipeline_model_parallel_size > 1:
        raise ConfigError(f"{' / '.join(map(_name, documents))} cannot run with --pipeline-model-parallel-size > 1 "
                          "yet: the pipeline stages' graphs do not trace the 4D per-document attention mask")  # fmt: skip
    if args.exit_duration_in_mins is not None and args.exit_duration_in_mins <= 0:
        raise ConfigError(f"--exit-duration-in-mins {args.exit_duration_in_mins:g} must be > 0")
    if args.min_loss_scale <= 0:
        raise ConfigError(f"--min-loss-scale {args.min_loss_scale:g} must be > 0")
    if args.fp16 and args.loss_scale is None and args.min_loss_scale > args.initial_loss_scale:
        raise ConfigError(f"--min-loss-scale {args.min_loss_scale:g} exceeds --initial-loss-scale "
                          f"{args.initial_loss_scale:g}")  # fmt: skip


def print_arguments(args: argparse.Namespace, title: str = "arguments") -> None:
    """Megatron-LM's dump of every argument at start (rank 0): sorted ``name .... value`` lines."""
    if int(os.environ.get("RANK", 0)) != 0:
        return
    lines = [f"  {name} {'.' * (48 - len(name))} {value}" for name, value in vars(args).items()]
    print(f"------------------------ {title} ------------------------", flush=True)
    for line in sorted(lines, key=str.lower):
        print(line, flush=True)
    print(f"-------------------- end of {title} ---------------------", flush=True)
