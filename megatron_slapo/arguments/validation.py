"""Validation of the trainer's arguments: every problem it can see before any compute, in one line.

:func:`validate_args` collects the missing required flags, the values out of range and the flags
that contradict each other (``arguments/problems.py``) and raises them as one
:class:`~megatron_slapo.errors.ConfigError`; what depends on derived values (the batch sizes, the
LR schedule) is checked after, one at a time. It also fills in what the flags imply (the
data-parallel size, the global batch, the LR schedule's lengths), so the arguments that leave it
are the ones the run uses.
"""

from __future__ import annotations

import argparse
import math
import re

from megatron_slapo.arguments.family_flags import flags_not_taken
from megatron_slapo.arguments.fp8_flags import check_fp8
from megatron_slapo.arguments.parser import (
    BERT_MODEL_TYPES,
    GPT_MODEL_TYPES,
    MOE_FLAGS,
    T5_MODEL_TYPES,
    VISION_MODEL_TYPES,
)
from megatron_slapo.arguments.problems import Problems
from megatron_slapo.arguments.trainer_args import TRAINER_MINIMUM, check_trainer_args, resolve_training_length
from megatron_slapo.errors import ConfigError

# Flags that must be at least this large when given (None means "not given", which later checks handle).
_MINIMUM = dict(
    tensor_model_parallel_size=1, pipeline_model_parallel_size=1, num_layers_per_virtual_pipeline_stage=1,
    expert_model_parallel_size=1, expert_tensor_parallel_size=1, context_parallel_size=1, micro_batch_size=1,
    global_batch_size=1, train_iters=1, seq_length=1, max_position_embeddings=1,
    num_layers=1, hidden_size=1, num_attention_heads=1, num_query_groups=1, ffn_hidden_size=1,
    num_experts=1, moe_ffn_hidden_size=1, moe_shared_expert_intermediate_size=1, moe_router_topk=1,
    make_vocab_size_divisible_by=1, lr_decay_iters=1, lr_warmup_iters=0, recompute_num_layers=1,
    eval_iters=0, log_interval=1, tensorboard_log_interval=1, save_interval=1, exit_interval=1, num_workers=0,
    max_consecutive_nan_iterations=1, vocab_size=1, lr=0.0, min_lr=0.0, weight_decay=0.0, clip_grad=0.0,
    adam_eps=0.0, initial_loss_scale=1.0, loss_scale=1.0, init_method_std=0.0, width_per_group=1, base_channels=1,
    img_h=1, img_w=1, num_channels=1, num_classes=2,
)  # fmt: skip
_PROBABILITIES = ("attention_dropout", "hidden_dropout", "adam_beta1", "adam_beta2", "lr_warmup_fraction",
                  "mask_prob", "short_seq_prob", "checkpoint_ratio")  # fmt: skip
# Flags that must lie within bounds when given: the rates, and the seed (the datasets seed numpy with it: 32 bits).
_BETWEEN = {**{name: (0, 1) for name in _PROBABILITIES}, "seed": (0, 2**32 - 1)}


def flag(args: argparse.Namespace, name: str) -> str:
    """``--name value`` as the user would write it, marked when the embedded run or the checkpoint in
    ``--load`` chose the value, so that an error never blames the user for a value they did not pass."""
    text = f"--{name.replace('_', '-')} {getattr(args, name)}"
    if name in getattr(args, "embedded_defaults", {}):
        return f"{text} (the embedded run's default)"
    return f"{text} (the checkpoint's, in --load)" if name in getattr(args, "checkpoint_defaults", {}) else text


def _check_ranges(args: argparse.Namespace, problems: Problems) -> None:
    """Floats that are not finite (``--lr inf``, ``--init-method-std nan``: any float flag), and
    sizes, counts and rates out of range, each named, before anything divides by them or trains on
    them. A value the embedded run chose is left out: its constants are in range, and the one it
    derives (``--min-lr``, a tenth of ``--lr``) is out of range only when the flag it follows is."""
    chosen = getattr(args, "embedded_defaults", {})
    given = {name: value for name, value in vars(args).items() if name not in chosen}
    for name, value in given.items():
        if isinstance(value, float) and not math.isfinite(value):
            problems.add(f"{flag(args, name)} must be a finite number")
    for name, minimum in {**_MINIMUM, **TRAINER_MINIMUM}.items():
        value = given.get(name)
        if value is not None and value < minimum:
            problems.add(f"{flag(args, name)} must be >= {minimum:g}")
    for name, (low, high) in _BETWEEN.items():
        value = given.get(name)
        if value is not None and not low <= value <= high:
            problems.add(f"{flag(args, name)} must lie between {low} and {high}")


def causal_lm_types() -> set[str]:
    """The model types transformers has a causal-LM class for."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def encoder_types() -> set[str]:
    """The model types transformers has a masked-LM class for (encoders, BERT's kind)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    return set(MODEL_FOR_MASKED_LM_MAPPING_NAMES)


def _check_required(args: argparse.Namespace, problems: Problems) -> None:
    """Every flag the run needs and was not given (the embedded run gives most of them)."""
    if args.micro_batch_size is None:
        problems.require("--micro-batch-size")
    if args.train_iters is None and args.train_samples is None:
        problems.require("--train-iters (or --train-samples)")
    if args.lr is None:
        problems.require("--lr")
    if args.task == "vision":
        return
    if not args.embedded_data and args.tokenizer_type is None:
        problems.require("--tokenizer-type")
    if args.task == "t5":  # a T5 config has no positions to take the length from
        for name in ("seq_length", "decoder_seq_length"):
            if getattr(args, name) is None:
                problems.require(f"--{name.replace('_', '-')}")
    if not (args.hf_config or args.load_hf):  # else the model's config gives them
        shape = ("num_layers", "hidden_size", "num_attention_heads") + (() if args.task == "t5" else ("seq_length",))
        for name in shape:
            if getattr(args, name) is None:
                problems.require(f"--{name.replace('_', '-')}", unless="--hf-config / --load-hf")


def default_model_type(task: str) -> str:
    """``--model-type``'s default in ``pretrain_<task>.py``: the type an ``--hf-config`` /
    ``--load-hf`` model's own replaces (any other ``--model-type`` must agree with it)."""
    families = {"gpt": GPT_MODEL_TYPES, "bert": BERT_MODEL_TYPES, "t5": T5_MODEL_TYPES, "vision": VISION_MODEL_TYPES}
    return families[task][0]


def _check_model_type(args: argparse.Namespace, problems: Problems) -> None:
    """``--model-type`` and the flags that shape its model: a family pretrain_gpt.py can train, experts only
    for an MoE one, and no flag the family's config has no place for (:mod:`.family_flags`)."""
    kind = args.model_type
    if args.task == "gpt" and kind not in GPT_MODEL_TYPES:
        if kind in encoder_types():  # HF can run some encoders as decoders; Megatron's GPT is causal
            problems.add(f"--model-type {kind} is an encoder: pretrain_gpt.py trains decoder-only models (for "
                         "encoders use pretrain_bert.py)")  # fmt: skip
        elif kind not in causal_lm_types():
            problems.add(f"unknown --model-type {kind!r}: give one of {', '.join(GPT_MODEL_TYPES)} or a transformers "
                         "causal-LM model type (e.g. qwen3, mistral)")  # fmt: skip
    moe = [name for name in MOE_FLAGS if getattr(args, name, None) is not None]
    if moe and (args.load_hf or args.hf_config or kind in (*GPT_MODEL_TYPES, *BERT_MODEL_TYPES, *T5_MODEL_TYPES)):
        problems.add(f"--{moe[0].replace('_', '-')} shapes the experts of an MoE --model-type built from the size "
                     "flags (mixtral, qwen3_moe, ...), not of this model")  # fmt: skip
    for problem in flags_not_taken(args):  # e.g. --num-query-groups for GPT-2, which has no grouped-query attention
        problems.add(problem)


def _check_pairs(args: argparse.Namespace, problems: Problems) -> None:
    """Flags that contradict each other, or need another flag, whatever their values."""
    tp, pp, engine = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.engine
    if engine != "deepspeed" and (args.zero_stage is not None or args.deepspeed_config):
        problems.add(f"--zero-stage and --deepspeed-config need --engine deepspeed, not {engine}")
    if engine != "megatron":
        if pp > 1 or args.num_layers_per_virtual_pipeline_stage:
            problems.add(f"pipeline parallelism needs --engine megatron; --engine {engine} has none")
        for name in ("use_distributed_optimizer", "overlap_grad_reduce", "accumulate_allreduce_grads_in_fp32",
                     "grad_reduce_in_bf16"):  # fmt: skip
            if getattr(args, name):
                problems.add(f"--{name.replace('_', '-')} needs --engine megatron, not {engine}")
    _check_expert_parallel(args, problems)
    if args.num_layers_per_virtual_pipeline_stage and pp == 1:
        problems.add("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
    if args.sequence_parallel and tp == 1:
        problems.add("--sequence-parallel splits what tensor parallelism replicates: it needs "
                     "--tensor-model-parallel-size > 1")  # fmt: skip
    if args.checkpoint_ratio is not None and args.recompute_granularity:
        problems.add("--checkpoint-ratio and --recompute-granularity both choose the recomputed layers: give one")
    if args.recompute_granularity == "full" and args.recompute_method == "uniform" and args.recompute_num_layers != 1:
        problems.add("--recompute-method uniform recomputes each layer as its own unit here: use --recompute-num-layers "
                     "1 (or --recompute-method block to recompute only some layers)")  # fmt: skip
    if args.bf16 and args.fp16:
        problems.add("--bf16 and --fp16 are mutually exclusive")
    if args.grad_reduce_in_bf16 and not args.bf16:
        problems.add("--grad-reduce-in-bf16 needs --bf16")
    if args.lr_warmup_fraction is not None and args.lr_warmup_iters:
        problems.add("give --lr-warmup-fraction or --lr-warmup-iters, not both")
    if args.save_interval and not args.save:
        problems.add("--save-interval needs --save DIR")
    if args.async_save and args.ckpt_format != "torch_dist":
        problems.add(f"--async-save needs --ckpt-format torch_dist, not {args.ckpt_format}")
    if args.ckpt_fully_parallel_load:
        problems.add("--ckpt-fully-parallel-load is not offered: with torch.distributed.checkpoint every rank reads "
                     "only the parts of tensors it holds, directly from the files")  # fmt: skip
    if args.finetune and not args.load:
        problems.add("--finetune needs --load DIR")
    if getattr(args, "exit_signal", "SIGTERM") != "SIGTERM" and not args.exit_signal_handler:
        problems.add(f"--exit-signal {args.exit_signal} is what --exit-signal-handler listens for: add "
                     "--exit-signal-handler (a Ctrl-C without it stops the run at once)")  # fmt: skip
    if args.use_checkpoint_args and not args.load:
        problems.add("--use-checkpoint-args needs --load DIR, the checkpoint to take the model's flags from")
    if args.load_hf and args.hf_config:
        problems.add("--load-hf takes its config from the checkpoint; drop --hf-config")


def _check_expert_parallel(args: argparse.Namespace, problems: Problems) -> None:
    """``--expert-model-parallel-size`` and ``--expert-tensor-parallel-size``: the layouts expert
    parallelism runs (plans/expert_parallel.py) and the engines that keep its two gradient groups."""
    ep, etp, tp = args.expert_model_parallel_size, args.expert_tensor_parallel_size, args.tensor_model_parallel_size
    if etp is not None and etp != tp and (ep == 1 or etp != 1):
        problems.add(f"--expert-tensor-parallel-size {etp}: the experts are split by their features over the "
                     f"tensor-parallel ranks ({tp}) or, with --expert-model-parallel-size > 1, not at all (1)")  # fmt: skip
    capacity = getattr(args, "moe_expert_capacity_factor", None)
    if capacity is not None and not capacity > 0:
        problems.add(f"--moe-expert-capacity-factor {capacity} must be > 0: each expert keeps that times an even "
                     "share of the routed tokens")  # fmt: skip
    if ep == 1:
        return
    if args.engine not in ("megatron", "ddp"):
        problems.add(f"--expert-model-parallel-size needs --engine megatron or ddp: --engine {args.engine} reduces "
                     "every gradient over the whole data-parallel group, and expert weights differ between its ranks")  # fmt: skip
    if tp > 1 and not args.sequence_parallel and etp == 1:
        problems.add("--expert-model-parallel-size with --tensor-model-parallel-size > 1 and experts not split by "
                     "features (--expert-tensor-parallel-size 1) needs --sequence-parallel: each tensor-parallel "
                     "rank must route different tokens (Megatron requires it too)")  # fmt: skip
    if args.ckpt_format == "torch" and (args.save or args.load):
        problems.add("--expert-model-parallel-size saves with --ckpt-format torch_dist: the torch format's files "
                     "hold one copy per tensor-parallel rank, and expert-parallel ranks hold different experts")  # fmt: skip


def _check_context_parallel(args: argparse.Namespace, problems: Problems) -> None:
    """``--context-parallel-size``: causal decoders' sequences, cut into ``2 x C`` equal chunks, with
    what the ring attention and the loss's sums across the ranks cover."""
    cp = args.context_parallel_size
    if cp == 1:
        return
    if args.task != "gpt":
        problems.add(f"--context-parallel-size {cp}: context parallelism splits causal self-attention: "
                     "pretrain_gpt.py's decoders only")  # fmt: skip
        return
    tp, seq = args.tensor_model_parallel_size, args.seq_length
    if seq and seq % (2 * cp):
        problems.add(f"{flag(args, 'seq_length')} must be divisible by 2 x --context-parallel-size {cp}: each rank "
                     "holds two equal chunks (one early, one late, so every rank attends as much)")  # fmt: skip
    elif seq and args.sequence_parallel and (seq // cp) % tp:
        problems.add(f"--sequence-parallel splits each context-parallel rank's {seq // cp} tokens: not divisible "
                     f"by --tensor-model-parallel-size {tp}")  # fmt: skip
    refused = {
        "--reset-attention-mask": args.reset_attention_mask,
        "--moe-aux-loss-coeff > 0 (its statistics span the whole sequence)": bool(getattr(args, "moe_aux_loss_coeff", 0)),
        "--moe-expert-capacity-factor (capacity counts a rank's tokens)": getattr(args, "moe_expert_capacity_factor",
                                                                                   None) is not None,
        "--engine deepspeed (ZeRO counts the data-parallel ranks in its batch)": args.engine == "deepspeed",
        f"--attention-backend {args.attention_backend} (the ring computes attention itself)":
            args.attention_backend not in ("auto", None),
    }  # fmt: skip
    for what, given in refused.items():
        if given:
            problems.add(f"--context-parallel-size {cp}: {what} is not supported with context parallelism")


def _check_language_pairs(args: argparse.Namespace, problems: Problems) -> None:
    """The data flags of pretrain_gpt.py, pretrain_bert.py and pretrain_t5.py, and what T5 does not do (yet)."""
    if args.data_path and args.mock_data:
        problems.add("give --data-path or --mock-data, not both")
    if args.embedded_data and (args.tokenizer_type or args.vocab_file or args.merge_file):
        problems.add("tokenizer flags need --data-path (the embedded corpus brings its own tokenizer)")
    parts = re.split("[,/]", args.split)
    if len(parts) > 3 or not all(re.fullmatch(r"\s*(\d+\.?\d*|\.\d+)\s*", part) for part in parts):
        problems.add(f"--split {args.split} must be up to three weights of the train, validation and test splits, "
                     "e.g. 969,30,1")  # fmt: skip
    elif not any(float(part) for part in parts):
        problems.add(f"--split {args.split} gives every split weight 0: give at least one weight > 0, e.g. 969,30,1")
    if args.task != "t5":
        return
    if args.num_query_groups is not None:
        problems.add("--num-query-groups: T5's attention has as many key/value heads as heads")
    if args.sequence_parallel:
        problems.add("--sequence-parallel: not supported for T5 yet")
    if args.pipeline_model_parallel_size > 2 or args.num_layers_per_virtual_pipeline_stage:
        problems.add("T5 is cut between its encoder and its decoder, where one activation crosses: "
                     "--pipeline-model-parallel-size 2 at most, without virtual stages")  # fmt: skip
    if args.vocab_extra_ids < 1:
        problems.add("--vocab-extra-ids must be >= 1: T5 marks each masked span with a sentinel")


def _check_vision_pairs(args: argparse.Namespace, problems: Problems) -> None:
    """What pretrain_vision.py does not do (yet)."""
    refused = {
        "--pipeline-model-parallel-size > 1": args.pipeline_model_parallel_size > 1,
        # a recomputed block would update its BatchNorms' running statistics a second time
        "recompute (--recompute-granularity, --checkpoint-ratio)": bool(args.recompute_granularity)
        or args.checkpoint_ratio is not None,
    }
    for what, given in refused.items():
        if given:
            problems.add(f"{what}: not supported for image models yet")
    stages = args.resnet_layers
    if not (args.load_hf or args.hf_config) and (not 1 <= len(stages) <= 4 or min(stages) < 1):
        problems.add("--resnet-layers takes one to four block counts (torchvision's stages), each >= 1")


def _check_values(args: argparse.Namespace, world_size: int, problems: Problems) -> None:
    """How the values of flags given in range relate: the world and the model parallel sizes, the
    attention heads and the width, the sequence lengths."""
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    if world_size % (tp * pp * cp):
        context = f" x context ({cp})" if cp > 1 else ""
        problems.add(f"world size {world_size} is not divisible by tensor ({tp}) x pipeline ({pp}){context} parallel "
                     "sizes")  # fmt: skip
    elif (world_size // (tp * pp)) % args.expert_model_parallel_size:
        problems.add(f"--expert-model-parallel-size {args.expert_model_parallel_size} must divide the data-parallel "
                     f"size, {world_size // (tp * pp)} (world {world_size} / (tensor {tp} x pipeline {pp})): the "
                     "expert-parallel ranks are carved out of the data-parallel ones")  # fmt: skip
    if args.task == "vision":
        if args.sequence_parallel and args.micro_batch_size % tp:
            problems.add(f"--sequence-parallel splits an image model's batch: {flag(args, 'micro_batch_size')} is not "
                         f"divisible by --tensor-model-parallel-size {tp}")  # fmt: skip
        return
    heads, groups = args.num_attention_heads, args.num_query_groups
    if not (args.hf_config or args.load_hf):  # the size flags shape the model (else read_hf_config checks it)
        if args.hidden_size % heads:
            problems.add(f"{flag(args, 'hidden_size')} is not divisible by {flag(args, 'num_attention_heads')}: "
                         "each head takes an equal slice of the width")  # fmt: skip
        if groups is not None and heads % groups:
            problems.add(f"--num-query-groups {groups} does not divide {flag(args, 'num_attention_heads')}: each "
                         "key/value head serves the same number of heads")  # fmt: skip
    if args.seq_length and args.max_position_embeddings and args.seq_length > args.max_position_embeddings:
        problems.add(f"{flag(args, 'seq_length')} exceeds {flag(args, 'max_position_embeddings')}")
    if args.task == "t5":
        # [BOS], then per span a sentinel and its tokens: at most 1 + 2 x the masked tokens
        needed = 1 + 2 * math.ceil(args.mask_prob * args.seq_length)
        if args.decoder_seq_length < needed:
            spans = f"the masked spans of {flag(args, 'seq_length')} at --mask-prob {args.mask_prob:g}"
            problems.add(f"{flag(args, 'decoder_seq_length')} cannot hold {spans}: it needs {needed}")


def validate_args(args: argparse.Namespace, world_size: int) -> None:
    """Raise a :class:`ConfigError` for the problems among the arguments and the world size.

    Every problem that does not wait on another's fix is in the one message: the missing flags,
    each flag's own value, how the values relate (once each is given and in range), the flags that
    contradict each other; then, one at a time, what is derived from them (batch sizes, the LR
    schedule).
    """
    problems = Problems()
    _check_ranges(args, problems)
    _check_required(args, problems)
    if not problems:
        _check_values(args, world_size, problems)
    _check_model_type(args, problems)
    _check_pairs(args, problems)
    if args.task == "vision":
        _check_vision_pairs(args, problems)
    else:
        _check_language_pairs(args, problems)
    _check_context_parallel(args, problems)
    check_fp8(args, problems)
    problems.raise_if_any()
    if args.task != "vision" and args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    dp = world_size // (tp * pp * args.context_parallel_size)  # Megatron's: context-parallel ranks read one batch
    args.data_parallel_size = dp
    resolve_training_length(args, dp)  # --train-samples sets --train-iters
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise ConfigError(
            f"global batch size ({args.global_batch_size}) is not divisible by micro batch size "
            f"({args.micro_batch_size}) x data-parallel size ({dp})"
        )
    microbatches = args.global_batch_size // (args.micro_batch_size * dp)
    if args.num_layers_per_virtual_pipeline_stage and microbatches % pp:
        raise ConfigError(
            f"the interleaved schedule needs a multiple of --pipeline-model-parallel-size ({pp}) micro-batches "
            f"per step; global batch size {args.global_batch_size} gives {microbatches}"
        )
    if args.min_lr > args.lr:
        raise ConfigError(f"{flag(args, 'min_lr')} must not exceed {flag(args, 'lr')}")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None:
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    if args.lr_decay_style != "constant" and args.lr_warmup_iters >= args.lr_decay_iters:
        raise ConfigError(
            f"LR warmup ({args.lr_warmup_iters} iterations) must end before the decay does ({args.lr_decay_iters})"
        )
    if args.eval_iters and args.eval_interval < 1:
        raise ConfigError("--eval-interval must be >= 1 (or --eval-iters 0 for no evaluation)")
    if args.task == "bert":
        args.bert_binary_head = args.bert_binary_head and args.model_type != "roberta"  # RoBERTa has no SOP head
    check_trainer_args(args)
