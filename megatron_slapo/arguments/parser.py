"""Command-line arguments, with Megatron-LM's names, and the embedded run's defaults.

Everything a Megatron-LM user passes to ``pretrain_gpt.py`` keeps its name and meaning
(``--tensor-model-parallel-size``, ``--micro-batch-size``, ``--lr-decay-style``, ``--save`` ...);
our additions sit beside them (``--schedule``, ``--model-type``, ``--hf-config``, ``--load-hf``,
``--engine``). Their validation is ``arguments/validation.py``'s.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from megatron_slapo.arguments.fp8_flags import add_fp8_arguments
from megatron_slapo.compat.argparse_internals import parser_actions
from megatron_slapo.errors import ConfigError

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
EMBEDDED_MODEL_SHAPE = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "resnet_layers",
                         "width_per_group", "base_channels")  # fmt: skip


def _model(p: argparse.ArgumentParser, model_types: Sequence[str]) -> None:
    g = p.add_argument_group("model")
    if model_types == GPT_MODEL_TYPES:  # any transformers causal LM, beyond those with a hand-written schedule
        g.add_argument("--model-type", default=model_types[0], metavar="TYPE",
                       help=f"HF model family: {', '.join(model_types)}, or any transformers causal-LM type "
                            "(llama-like: qwen3, mistral, ...) with --schedule auto")  # fmt: skip
    else:
        g.add_argument("--model-type", choices=model_types, default=model_types[0], help="HF model family")
    g.add_argument("--hf-config", help="HF config name or directory, or a checkpoint directory (the model it records), "
                                       "instead of the size flags")  # fmt: skip
    g.add_argument("--load-hf", metavar="DIR", help="start from the pretrained HF weights in DIR")
    g.add_argument("--schedule", help="schedules/NAME.py to apply; 'list' prints them (default: under TP, the family's "
                                      "own tensor-parallel schedule (gpt_tp, llama_tp, bert_tp, t5_tp, ...), else auto "
                                      "for a family it is verified on, else default)")  # fmt: skip
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
    g.add_argument("--moe-expert-capacity-factor", type=float,
                   help="each expert takes at most this times an even share of the routed tokens; the others are "
                        "dropped and counted on the log line (default: no limit)")  # fmt: skip
    g.add_argument("--moe-token-drop-policy", choices=("probs", "position"), default="probs",
                   help="with --moe-expert-capacity-factor, which tokens an expert keeps: those of highest routing "
                        "probability, or the first ones")  # fmt: skip
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0,
                   help="the coefficient of an MoE model's load-balancing loss, added to the loss (> 0 turns it on; "
                        "default 0: as the model's config says, output_router_logits and router_aux_loss_coef)")  # fmt: skip
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
    g.add_argument("--schedule", help="schedules/NAME.py to apply; 'list' prints them "
                                      "(default: wideresnet_tp under TP, else default)")  # fmt: skip
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
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="MoE: ranks the routed experts are split across, whole experts each, carved out of the "
                        "data-parallel ranks; tokens are sent to their experts' ranks")  # fmt: skip
    g.add_argument("--expert-tensor-parallel-size", type=int,
                   help="MoE: ranks each expert is split across by its features (default: the TP size; with "
                        "--expert-model-parallel-size > 1 also 1)")  # fmt: skip
    g.add_argument("--moe-token-dispatcher-type", choices=("alltoall", "allgather"), default="alltoall",
                   help="how tokens reach the expert-parallel ranks: all-to-all of the routed tokens, or every "
                        "rank gathering all tokens")  # fmt: skip
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="ranks each sequence is split across through every layer (causal decoders), carved out of "
                        "the data-parallel ranks; attention brings the other ranks' keys and values")  # fmt: skip
    g.add_argument("--cp-comm-type", choices=("p2p", "allgather"), default="p2p",
                   help="how attention gets the other context-parallel ranks' keys and values: passed round a ring, "
                        "overlapped with compute, or all gathered at once")  # fmt: skip
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
                   help="on --exit-signal, finish the step, save (with --save) and exit")  # fmt: skip
    g.add_argument("--exit-signal", choices=("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"), default="SIGTERM",
                   help="the signal --exit-signal-handler waits for (SIGTERM: SLURM's; SIGINT: a Ctrl-C)")  # fmt: skip
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
    add_fp8_arguments(g)
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
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model's flags not given (its size, sequence length, tokenizer) from the checkpoint "
                        "in --load, which must hold one (a --load holding one supplies them without this flag too)")  # fmt: skip
    g.add_argument(
        "--ckpt-format",
        choices=["torch_dist", "torch"],
        default="torch_dist",
        help="torch_dist: every tensor once by its global identity (torch.distributed.checkpoint), loadable "
        "at any TP/PP/DP size and engine; torch: Megatron's legacy mp_rank_XX files, one layout only",
    )
    g.add_argument(
        "--auto-detect-ckpt-format",
        action="store_true",
        help="--load a checkpoint of either format (it saves in --ckpt-format)",
    )
    g.add_argument(
        "--async-save",
        action="store_true",
        help="(torch_dist) write checkpoints in the background while training goes on; the tracker moves "
        "only once every rank's files are on disk",
    )
    g.add_argument(
        "--ckpt-fully-parallel-save",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="(torch_dist) data-parallel replicas share the writing of the tensors they hold alike "
        "(otherwise the lowest rank holding one writes it)",
    )
    g.add_argument(
        "--ckpt-fully-parallel-load",
        action="store_true",
        help="(not offered: with torch.distributed.checkpoint every rank reads only the boxes it needs)",
    )
    g.add_argument("--overwrite-checkpoints", action="store_true",
                   help="let --save write into a directory holding iterations this run did not load from (a new "
                        "run, --finetune, or --load elsewhere): those it saves again are replaced, the others stay "
                        "but are no longer the latest. Without it such a run is refused before it starts")  # fmt: skip


def _logging(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", help="where to write TensorBoard events (default: none for a run on "
                   "--data-path/--mock-data; otherwise runs/<task>-<model type>-<layers>x<hidden>-tp<T>pp<P>dp<D>-"
                   "<schedule>/<time>, printed at start)")  # fmt: skip
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


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, as every other input error is: a
    :class:`ConfigError` pointing to ``--help`` rather than the usage (dozens of lines), which the
    caller's ``error_report.user_errors`` prints once for the job (not once per rank) as
    ``prog: error: message``, the line torchrun's summary then names."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (see {self.prog} --help)")


def build_parser(task: str, prog: str | None = None) -> argparse.ArgumentParser:
    """``pretrain_<task>.py``'s flags (``prog``: the name its errors and help go by, for a tool
    that takes the trainer's flags)."""
    if task == "vision":
        p = OneLineParser(
            prog=prog or "pretrain_vision.py", allow_abbrev=False,
            description="Train an image classifier (WideResNet) with a megatron_slapo schedule, on a generated "
            "image set (megatron_slapo/data/images.py).",
            epilog="Defaults for every flag not given: " + _listed_defaults(VISION_DEFAULTS)
            + " (--min-lr is a tenth of a given --lr; --load-hf/--hf-config keep the model's own shape).",
        )  # fmt: skip
        _vision_model(p)
    else:
        kind = {"bert": "masked LM", "t5": "encoder-decoder (T5, span corruption)", "gpt": "causal LM"}[task]
        p = OneLineParser(
            prog=prog or f"pretrain_{task}.py",
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


def parse_args(task: str, argv: Sequence[str] | None = None, prog: str | None = None) -> argparse.Namespace:
    """Parse ``argv``; with no data flags, default to the embedded corpus and a small model
    (``prog``: see :func:`build_parser`)."""
    parser = build_parser(task, prog)
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
            if name in passed or (shaped_elsewhere and name in EMBEDDED_MODEL_SHAPE):
                continue
            if name == "lr_warmup_fraction" and "lr_warmup_iters" in passed:
                continue  # the user chose the warmup in iterations
            if name == "min_lr" and "lr" in passed:
                value = args.lr / 10  # follow the user's --lr rather than contradict it
            setattr(args, name, value)
            args.embedded_defaults[name] = value
    return args
