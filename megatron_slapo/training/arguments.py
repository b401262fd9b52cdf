"""Command-line arguments, with Megatron-LM's names, and their validation.

Everything a Megatron-LM user passes to ``pretrain_gpt.py`` keeps its name and meaning
(``--tensor-model-parallel-size``, ``--micro-batch-size``, ``--lr-decay-style``, ``--save`` ...);
our additions sit beside them (``--schedule``, ``--model-type``, ``--hf-config``, ``--load-hf``,
``--engine``). :func:`validate_args` turns every contradiction it can see before any compute into
one :class:`~megatron_slapo.errors.ConfigError`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence

from megatron_slapo.compat.argparse_internals import parser_actions
from megatron_slapo.errors import ConfigError
from megatron_slapo.training.trainer_args import check_trainer_args, resolve_training_length

GPT_MODEL_TYPES = ("gpt2", "gpt_neo", "opt", "llama")
BERT_MODEL_TYPES = ("bert", "roberta", "albert")
T5_MODEL_TYPES = ("t5",)
VISION_MODEL_TYPES = ("wideresnet",)

# Megatron's MoE flags: they shape the experts of an MoE --model-type built from the size flags
MOE_FLAGS = ("num_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_router_topk")

# The embedded default run (no data flags): a small model that trains in minutes on 2 CPU cores.
# Each value applies only where the user gave no flag of that name; the start of the run lists them.
EMBEDDED_DEFAULTS = dict(
    num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=128, micro_batch_size=8,
    global_batch_size=16, train_iters=200, lr=1e-3, min_lr=1e-4, lr_warmup_fraction=0.1,
    lr_decay_style="cosine", eval_interval=50, eval_iters=4, log_interval=10, num_workers=0,
)  # fmt: skip
# pretrain_t5.py's embedded run: a decoder long enough for the spans of 15% of 128 tokens
T5_EMBEDDED_DEFAULTS = {**EMBEDDED_DEFAULTS, "decoder_seq_length": 64}
# pretrain_vision.py's defaults (it always trains on the generated image set): a WideResNet that
# reaches high accuracy in a few minutes on 2 CPU cores.
VISION_DEFAULTS = dict(
    resnet_layers=[1, 1, 1, 1], width_per_group=32, base_channels=16, img_h=32, img_w=32, micro_batch_size=32,
    global_batch_size=64, train_iters=100, lr=2e-3, min_lr=2e-4, lr_warmup_fraction=0.1, lr_decay_style="cosine",
    eval_interval=25, eval_iters=4, log_interval=10, num_workers=0,
)  # fmt: skip
# The model's shape comes from the checkpoint or config when one is given (--load-hf / --hf-config).
_EMBEDDED_MODEL_SHAPE = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "resnet_layers",
                         "width_per_group", "base_channels")  # fmt: skip

# Flags that must be at least this large when given (None means "not given", which later checks handle).
_MINIMUM = dict(
    tensor_model_parallel_size=1, pipeline_model_parallel_size=1, num_layers_per_virtual_pipeline_stage=1,
    micro_batch_size=1, global_batch_size=1, train_iters=1, seq_length=1, max_position_embeddings=1,
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


def _model(p: argparse.ArgumentParser, model_types: Sequence[str]) -> None:
    g = p.add_argument_group("model")
    if model_types == GPT_MODEL_TYPES:  # any transformers causal LM, beyond those with a hand-written schedule
        g.add_argument("--model-type", default=model_types[0], metavar="TYPE",
                       help=f"HF model family: {', '.join(model_types)}, or any transformers causal-LM type "
                            "(llama-like: qwen3, mistral, ...) with --schedule auto")  # fmt: skip
    else:
        g.add_argument("--model-type", choices=model_types, default=model_types[0], help="HF model family")
    g.add_argument("--hf-config", help="HF config name or directory (instead of the size flags)")
    g.add_argument("--load-hf", metavar="DIR", help="start from the pretrained HF weights in DIR")
    g.add_argument("--schedule", help="schedules/NAME.py to apply; 'list' prints them (default: under TP, auto for a "
                                      "family it is verified on without a schedule of its own, else default)")  # fmt: skip
    g.add_argument("--num-layers", type=int)
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--num-attention-heads", type=int)
    g.add_argument("--num-query-groups", type=int, help="key/value heads (grouped-query attention)")
    g.add_argument("--ffn-hidden-size", type=int, help="default: 4 x hidden size")
    g.add_argument("--num-experts", type=int, help="experts per MoE layer (required for an MoE --model-type)")
    g.add_argument(
        "--moe-ffn-hidden-size",
        type=int,
        help="each expert's FFN width (default: --ffn-hidden-size scaled as the family scales it)",
    )
    g.add_argument(
        "--moe-shared-expert-intermediate-size",
        type=int,
        help="the shared experts' FFN width, for families that have them (default: --ffn-hidden-size scaled as "
        "the family scales it)",
    )
    g.add_argument("--moe-router-topk", type=int, help="experts per token (default: the family's)")
    if model_types == T5_MODEL_TYPES:  # Megatron's T5 flag names the encoder's length
        g.add_argument("--seq-length", "--encoder-seq-length", type=int, help="the encoder's sequence length")
        g.add_argument("--decoder-seq-length", type=int, help="the decoder's (sentinels and masked spans)")
    else:
        g.add_argument("--seq-length", type=int)
    g.add_argument("--max-position-embeddings", type=int, help="default: --seq-length")
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--attention-backend", choices=("auto", "flash", "fused", "unfused", "local"), default="auto",
                   help="flash/fused: torch SDPA on only its flash / cuDNN-or-memory-efficient kernels; "
                        "unfused/local: softmax(q kT) v in plain ops (HF 'eager'); auto: the model's default "
                        "(SDPA, torch picks the kernel)")  # fmt: skip
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)


def _vision_model(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model-type", choices=VISION_MODEL_TYPES, default=VISION_MODEL_TYPES[0], help="model family")
    g.add_argument("--hf-config", help="config directory (instead of the size flags)")
    g.add_argument("--load-hf", metavar="DIR", help="start from the pretrained weights in DIR (save_pretrained)")
    g.add_argument("--schedule", help="schedules/NAME.py to apply; 'list' prints them (default: default)")
    g.add_argument("--resnet-layers", type=int, nargs="+", metavar="N",
                   help="bottleneck blocks per stage (WideResNet-50: 3 4 6 3)")  # fmt: skip
    g.add_argument("--width-per-group", type=int, help="bottleneck width per 64 planes (WideResNet-50-2: 128)")
    g.add_argument("--base-channels", type=int, help="stem channels and the first stage's planes (torchvision: 64)")
    g.add_argument("--img-h", type=int, help="image height")
    g.add_argument("--img-w", type=int, help="image width")
    g.add_argument("--num-channels", type=int, default=3)
    g.add_argument("--num-classes", type=int, default=10)


def _parallel(p: argparse.ArgumentParser) -> None:
    from megatron_slapo.engines import ENGINES

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--engine", choices=sorted(ENGINES), default="megatron")
    g.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), help="--engine deepspeed (default 1)")
    g.add_argument("--deepspeed-config", metavar="JSON", help="--engine deepspeed: extra DeepSpeed settings")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, help="interleaved 1F1B (--engine megatron)")
    g.add_argument("--use-distributed-optimizer", action="store_true", help="--engine megatron: ZeRO-1 over DP")
    g.add_argument("--overlap-grad-reduce", action="store_true", help="--engine megatron")
    g.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="split the activations between tensor-parallel regions along the sequence",
    )
    g.add_argument("--distributed-timeout-minutes", type=int, default=10,
                   help="timeout of the process groups' collectives and of their start-up")  # fmt: skip


def _training(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int)
    g.add_argument("--global-batch-size", type=int, help="default: micro batch x data-parallel size")
    g.add_argument("--train-iters", type=int)
    g.add_argument("--train-samples", type=int, help="train this many samples (instead of --train-iters)")
    g.add_argument("--exit-interval", type=int, help="stop (and save) when the iteration is a multiple of this")
    g.add_argument("--exit-duration-in-mins", type=float, help="stop (and save) after this many minutes")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM, finish the step, save (with --save) and exit")  # fmt: skip
    g.add_argument("--lr", type=float)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument(
        "--lr-decay-style", choices=("constant", "linear", "cosine", "inverse-square-root"), default="linear"
    )
    g.add_argument("--lr-decay-iters", type=int, help="default: --train-iters")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float)
    g.add_argument("--lr-decay-samples", type=int, help="with --train-samples (default: --train-samples)")
    g.add_argument("--lr-warmup-samples", type=int, default=0, help="with --train-samples")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument(
        "--accumulate-allreduce-grads-in-fp32",
        action="store_true",
        help="--fp16 on --engine megatron: fp32 gradient buffers (the default with --bf16, as Megatron)",
    )
    g.add_argument(
        "--grad-reduce-in-bf16",
        action="store_true",
        help="--bf16 on --engine megatron: accumulate and reduce gradients in bf16 (half the bytes)",
    )
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--loss-scale", type=float, help="static fp16 loss scale (default: dynamic)")
    g.add_argument("--loss-scale-window", type=int, default=1000, help="clean steps before the dynamic scale doubles")
    g.add_argument("--hysteresis", type=int, default=2, help="overflows tolerated before the dynamic scale backs off")
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="the dynamic scale never backs off below this")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument(
        "--recompute-granularity",
        choices=("full", "selective"),
        help="full: recompute whole layers; selective: only their attention core",
    )
    g.add_argument(
        "--recompute-method",
        choices=("uniform", "block"),
        default="uniform",
        help="per pipeline stage: uniform recomputes every layer, block the first --recompute-num-layers",
    )
    g.add_argument("--recompute-num-layers", type=int, default=1)
    g.add_argument(
        "--checkpoint-ratio",
        type=float,
        help="recompute this fraction of each pipeline stage's layers, its first ones (Slapo's knob)",
    )
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer layer (inductor; the first steps compile)")  # fmt: skip
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--max-consecutive-nan-iterations", type=int, default=5,
                   help="stop the run after this many iterations in a row with a NaN/inf loss or grad")  # fmt: skip


def _data(p: argparse.ArgumentParser, task: str) -> None:
    from megatron_slapo.data.tokenizers import TOKENIZER_TYPES

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", help="PREFIX ... or W1 PREFIX1 W2 PREFIX2 ... (default: embedded corpus)")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--data-cache-path", help="where index caches and the embedded corpus are built")
    g.add_argument("--num-workers", type=int, default=2)
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES)
    g.add_argument("--vocab-file")
    g.add_argument("--merge-file")
    g.add_argument("--tokenizer-model")
    g.add_argument("--vocab-size", type=int)
    if task in ("bert", "t5"):
        g.add_argument("--mask-prob", type=float, default=0.15)
        g.add_argument("--short-seq-prob", type=float, default=0.1)
    if task == "bert":
        g.add_argument("--bert-no-binary-head", dest="bert_binary_head", action="store_false")
    elif task == "t5":
        g.add_argument("--vocab-extra-ids", type=int, default=100, help="sentinel tokens added to the vocabulary")
    else:  # gpt
        g.add_argument("--reset-position-ids", action="store_true", help="positions restart after each end-of-document")
        g.add_argument("--reset-attention-mask", action="store_true", help="tokens attend only within their document")
        g.add_argument("--eod-mask-loss", action="store_true", help="no loss on end-of-document tokens")


def _checkpointing(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save")
    g.add_argument("--load")
    g.add_argument("--save-interval", type=int)
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true", help="load only the model weights; start at iteration 0")


def _logging(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir")
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--log-throughput", action="store_true", help="(always on: the log line shows TFLOP/s and tokens/s)")
    g.add_argument("--log-timers-to-tensorboard", action="store_true")
    g.add_argument("--log-memory-to-tensorboard", action="store_true")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--log-params-norm", action="store_true")
    g.add_argument("--log-comm", action="store_true", help="bytes per collective type and process group, per step")
    g.add_argument("--peak-tflops", type=float, help="device peak for MFU (default: known GPUs; none for CPUs)")


def _listed_defaults(defaults: dict) -> str:
    return " ".join(f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                    for k, v in defaults.items())  # fmt: skip


def build_parser(task: str) -> argparse.ArgumentParser:
    if task == "vision":
        p = argparse.ArgumentParser(
            prog="pretrain_vision.py", allow_abbrev=False,
            description="Train an image classifier (WideResNet) with a megatron_slapo schedule, on a generated "
            "image set (megatron_slapo/data/images.py).",
            epilog="Defaults for every flag not given: " + _listed_defaults(VISION_DEFAULTS)
            + " (--min-lr is a tenth of a given --lr; --load-hf/--hf-config keep the model's own shape).",
        )  # fmt: skip
        _vision_model(p)
    else:
        kind = {"bert": "masked LM", "t5": "encoder-decoder (T5, span corruption)", "gpt": "causal LM"}[task]
        p = argparse.ArgumentParser(
            prog=f"pretrain_{task}.py",
            allow_abbrev=False,
            description=f"Pretrain a HuggingFace {kind} with a megatron_slapo schedule.",
            epilog="With neither --data-path nor --mock-data the run trains on the embedded corpus, and these "
            "defaults replace the ones above for every flag not given: "
            + _listed_defaults(T5_EMBEDDED_DEFAULTS if task == "t5" else EMBEDDED_DEFAULTS)
            + " (--min-lr is a tenth of a given --lr; --load-hf/--hf-config keep the model's own shape and "
            "positions).",
        )  # fmt: skip
        _model(p, {"bert": BERT_MODEL_TYPES, "t5": T5_MODEL_TYPES, "gpt": GPT_MODEL_TYPES}[task])
    _parallel(p)
    _training(p)
    if task == "vision":
        p.add_argument_group("data").add_argument("--num-workers", type=int, default=2)
    else:
        _data(p, task)
    _checkpointing(p)
    _logging(p)
    return p


def parse_args(task: str, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``argv``; with no data flags, default to the embedded corpus and a small model."""
    parser = build_parser(task)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.task = task
    args.embedded_data = task != "vision" and not args.data_path and not args.mock_data
    args.embedded_defaults = {}  # what the embedded run chose for the user, to list and to name in errors
    embedded = T5_EMBEDDED_DEFAULTS if task == "t5" else EMBEDDED_DEFAULTS
    defaults = VISION_DEFAULTS if task == "vision" else embedded if args.embedded_data else {}
    if defaults:
        given = {arg.split("=")[0] for arg in argv if arg.startswith("--")}
        flags = {a.dest: set(a.option_strings) for a in parser_actions(parser)}
        shaped_elsewhere = args.load_hf or args.hf_config
        passed = {name for name, options in flags.items() if options & given}
        for name, value in defaults.items():
            if name in passed or (shaped_elsewhere and name in _EMBEDDED_MODEL_SHAPE):
                continue
            if name == "lr_warmup_fraction" and "lr_warmup_iters" in passed:
                continue  # the user chose the warmup in iterations
            if name == "min_lr" and "lr" in passed:
                value = args.lr / 10  # follow the user's --lr rather than contradict it
            setattr(args, name, value)
            args.embedded_defaults[name] = value
        if args.tensorboard_dir is None:
            run = f"pretrain_{task}" if task == "vision" else f"pretrain_{task}-embedded"
            args.tensorboard_dir = os.path.join("runs", run, time.strftime("%Y%m%d-%H%M%S"))
    return args


def flag(args: argparse.Namespace, name: str) -> str:
    """``--name value`` as the user would write it, marked when the embedded run chose the value,
    so that an error never blames the user for a value they did not pass."""
    text = f"--{name.replace('_', '-')} {getattr(args, name)}"
    return f"{text} (the embedded run's default)" if name in getattr(args, "embedded_defaults", {}) else text


def _check_ranges(args: argparse.Namespace) -> None:
    """Sizes, counts and rates out of range: one error naming the flag, before anything divides by them."""
    for name, minimum in _MINIMUM.items():
        value = getattr(args, name, None)
        if value is not None and value < minimum:
            raise ConfigError(f"{flag(args, name)} must be >= {minimum:g}")
    for name in _PROBABILITIES:
        value = getattr(args, name, None)
        if value is not None and not 0.0 <= value <= 1.0:
            raise ConfigError(f"{flag(args, name)} must lie between 0 and 1")


def causal_lm_types() -> set[str]:
    """The model types transformers has a causal-LM class for."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def encoder_types() -> set[str]:
    """The model types transformers has a masked-LM class for (encoders, BERT's kind)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    return set(MODEL_FOR_MASKED_LM_MAPPING_NAMES)


def _validate_language(args: argparse.Namespace) -> None:
    """The data and sequence flags of pretrain_gpt.py, pretrain_bert.py and pretrain_t5.py."""
    if args.task == "t5":
        _validate_t5(args)
    if args.data_path and args.mock_data:
        raise ConfigError("give --data-path or --mock-data, not both")
    if args.embedded_data and (args.tokenizer_type or args.vocab_file or args.merge_file):
        raise ConfigError("tokenizer flags need --data-path (the embedded corpus brings its own tokenizer)")
    if not args.embedded_data and args.tokenizer_type is None:
        raise ConfigError("--tokenizer-type is required with --data-path / --mock-data")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length is None and (args.task == "t5" or not (args.hf_config or args.load_hf)):
        raise ConfigError("--seq-length is required")  # a T5 config has no positions to take it from
    if args.seq_length and args.max_position_embeddings and args.seq_length > args.max_position_embeddings:
        raise ConfigError(
            f"{flag(args, 'seq_length')} exceeds --max-position-embeddings {args.max_position_embeddings}"
        )


def _validate_t5(args: argparse.Namespace) -> None:
    """pretrain_t5.py: the decoder must hold every masked span, and what it does not do (yet)."""
    if args.decoder_seq_length is None:
        raise ConfigError("--decoder-seq-length is required")
    if args.num_query_groups is not None:
        raise ConfigError("--num-query-groups: T5's attention has as many key/value heads as heads")
    if args.seq_length:
        # [BOS], then per span a sentinel and its tokens: at most 1 + 2 x the masked tokens
        needed = 1 + 2 * math.ceil(args.mask_prob * args.seq_length)
        if args.decoder_seq_length < needed:
            raise ConfigError(f"{flag(args, 'decoder_seq_length')} cannot hold the masked spans of "
                              f"{flag(args, 'seq_length')} at --mask-prob {args.mask_prob:g}: it needs {needed}")  # fmt: skip
    if args.sequence_parallel:
        raise ConfigError("--sequence-parallel: not supported for T5 yet")
    if args.pipeline_model_parallel_size > 2 or args.num_layers_per_virtual_pipeline_stage:
        raise ConfigError("T5 is cut between its encoder and its decoder, where one activation crosses: "
                          "--pipeline-model-parallel-size 2 at most, without virtual stages")  # fmt: skip
    if args.vocab_extra_ids < 1:
        raise ConfigError("--vocab-extra-ids must be >= 1: T5 marks each masked span with a sentinel")


def _validate_vision(args: argparse.Namespace) -> None:
    """What pretrain_vision.py does not do (yet): one line each, before anything is built."""
    if args.sequence_parallel and args.micro_batch_size % args.tensor_model_parallel_size:
        raise ConfigError(f"--sequence-parallel splits an image model's batch: {flag(args, 'micro_batch_size')} is not "
                          f"divisible by --tensor-model-parallel-size {args.tensor_model_parallel_size}")  # fmt: skip
    refused = {
        "--pipeline-model-parallel-size > 1": args.pipeline_model_parallel_size > 1,
        # a recomputed block would update its BatchNorms' running statistics a second time
        "recompute (--recompute-granularity, --checkpoint-ratio)": bool(args.recompute_granularity)
        or args.checkpoint_ratio is not None,
    }
    for what, given in refused.items():
        if given:
            raise ConfigError(f"{what}: not supported for image models yet")
    stages = args.resnet_layers
    if not (args.load_hf or args.hf_config) and (not 1 <= len(stages) <= 4 or min(stages) < 1):
        raise ConfigError("--resnet-layers takes one to four block counts (torchvision's stages), each >= 1")


def validate_args(args: argparse.Namespace, world_size: int) -> None:
    """Raise one ConfigError for the first contradiction among the arguments and the world size."""
    _check_ranges(args)
    if args.task == "gpt" and args.model_type not in GPT_MODEL_TYPES:
        if args.model_type in encoder_types():  # HF can run some encoders as decoders; Megatron's GPT is causal
            raise ConfigError(f"--model-type {args.model_type} is an encoder: pretrain_gpt.py trains decoder-only "
                              "models (for encoders use pretrain_bert.py)")  # fmt: skip
        if args.model_type not in causal_lm_types():
            raise ConfigError(f"unknown --model-type {args.model_type!r}: give one of {', '.join(GPT_MODEL_TYPES)} or "
                              "a transformers causal-LM model type (e.g. qwen3, mistral)")  # fmt: skip
    moe = [name for name in MOE_FLAGS if getattr(args, name, None) is not None]
    if moe and (args.load_hf or args.hf_config or args.model_type in (*GPT_MODEL_TYPES, *BERT_MODEL_TYPES,
                                                                      *T5_MODEL_TYPES)):  # fmt: skip
        raise ConfigError(f"--{moe[0].replace('_', '-')} shapes the experts of an MoE --model-type built from the "
                          "size flags (mixtral, qwen3_moe, ...), not of this model")  # fmt: skip
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world_size % (tp * pp):
        raise ConfigError(f"world size {world_size} is not divisible by tensor ({tp}) x pipeline ({pp}) parallel sizes")
    if args.engine != "deepspeed" and (args.zero_stage is not None or args.deepspeed_config):
        raise ConfigError(f"--zero-stage and --deepspeed-config need --engine deepspeed, not {args.engine}")
    if args.engine != "megatron":
        if pp > 1 or args.num_layers_per_virtual_pipeline_stage:
            raise ConfigError(f"pipeline parallelism needs --engine megatron; --engine {args.engine} has none")
        for name in (
            "use_distributed_optimizer",
            "overlap_grad_reduce",
            "accumulate_allreduce_grads_in_fp32",
            "grad_reduce_in_bf16",
        ):
            if getattr(args, name):
                raise ConfigError(f"--{name.replace('_', '-')} needs --engine megatron, not {args.engine}")
    if args.num_layers_per_virtual_pipeline_stage and pp == 1:
        raise ConfigError("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
    if args.sequence_parallel:
        if tp == 1:
            raise ConfigError("--sequence-parallel splits what tensor parallelism replicates: it needs "
                              "--tensor-model-parallel-size > 1")  # fmt: skip
    if args.checkpoint_ratio is not None and args.recompute_granularity:
        raise ConfigError("--checkpoint-ratio and --recompute-granularity both choose the recomputed layers: give one")
    if args.recompute_granularity == "full" and args.recompute_method == "uniform" and args.recompute_num_layers != 1:
        raise ConfigError("--recompute-method uniform recomputes each layer as its own unit here: use "
                          "--recompute-num-layers 1 (or --recompute-method block to recompute only some layers)")  # fmt: skip
    dp = world_size // (tp * pp)
    args.data_parallel_size = dp
    resolve_training_length(args, dp)  # --train-samples sets --train-iters
    for name in ("micro_batch_size", "train_iters", "lr"):
        if getattr(args, name) is None:
            raise ConfigError(f"--{name.replace('_', '-')} is required")
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
    if args.bf16 and args.fp16:
        raise ConfigError("--bf16 and --fp16 are mutually exclusive")
    if args.grad_reduce_in_bf16 and not args.bf16:
        raise ConfigError("--grad-reduce-in-bf16 needs --bf16")
    if args.lr_warmup_fraction is not None and args.lr_warmup_iters:
        raise ConfigError("give --lr-warmup-fraction or --lr-warmup-iters, not both")
    if args.save_interval and not args.save:
        raise ConfigError("--save-interval needs --save DIR")
    if args.finetune and not args.load:
        raise ConfigError("--finetune needs --load DIR")
    if args.load_hf and args.hf_config:
        raise ConfigError("--load-hf takes its config from the checkpoint; drop --hf-config")
    if args.task == "vision":
        _validate_vision(args)
    else:
        _validate_language(args)
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
