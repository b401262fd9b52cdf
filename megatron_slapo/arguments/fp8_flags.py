"""Megatron's FP8 flags (``--fp8-format``, ``--fp8-recipe``, ``--fp8-param-gather``) and their checks.

Megatron-LM trains in FP8 through Transformer Engine; we do through torchao (the products of the
transformer blocks' Linear layers, :mod:`megatron_slapo.plans.fp8`). The flags keep Megatron's
names and meanings where torchao has the recipe: ``--fp8-format e4m3|hybrid`` turns FP8 on (hybrid:
e5m2 for the gradients), ``--fp8-recipe`` says how scales are taken. Transformer Engine's
``delayed`` scaling (scales from an amax history) and its block / MX formats have no torchao
training recipe here, so they are refused with what to use instead.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from megatron_slapo.arguments.problems import Problems
from megatron_slapo.compat.versions import UnsupportedVersionError, check_versions, installed_version
from megatron_slapo.errors import ConfigError
from megatron_slapo.kernels.fp8 import FORMATS, RECIPES, Fp8Recipe

# Megatron's other recipes, and why they are not offered
UNAVAILABLE = {
    "delayed": "Transformer Engine's delayed scaling (scales from an amax history) has no torchao training "
    "recipe; tensorwise takes each scale from the tensor itself, which delayed scaling approximates",
    "blockwise": "block-scaled FP8 needs Transformer Engine (or torchao's prototype CUDA-only kernels)",
    "mxfp8": "MX formats need Blackwell GPUs and torchao's prototype MX training",
}
MIN_CAPABILITY = (8, 9)  # FP8 matrix units: Ada (8.9) and Hopper (9.0) onwards


def add_fp8_arguments(g: Any) -> None:
    """The FP8 flags, added to ``g``: the parser's training group (an argparse argument group)."""
    g.add_argument("--fp8-format", help=f"train the transformer layers' Linear products in FP8 ({' or '.join(FORMATS)}; "
                   "hybrid: e4m3 forward, e5m2 gradients); needs --bf16. Emulated (and said so) without FP8 hardware")  # fmt: skip
    g.add_argument("--fp8-recipe", default="tensorwise",
                   help=f"how FP8 scales are taken: {' or '.join(RECIPES)} (torchao's; default tensorwise)")  # fmt: skip
    g.add_argument("--fp8-param-gather", action="store_true",
                   help="--engine fsdp: all-gather the weights in FP8 (torchao's float8 all-gather), tensorwise only")  # fmt: skip


def check_fp8(args: argparse.Namespace, problems: Problems) -> None:
    """Each FP8 flag's value, and the flags FP8 needs or excludes."""
    if args.fp8_format is None:
        if args.fp8_param_gather:
            problems.add("--fp8-param-gather needs --fp8-format")
        return
    if args.task == "vision":
        problems.add("--fp8-format trains transformer layers' Linear products in FP8; WideResNet has convolutions")
        return
    if args.fp8_format not in FORMATS:
        problems.add(f"--fp8-format {args.fp8_format}: expected {' or '.join(FORMATS)}")
    if args.fp8_recipe in UNAVAILABLE:
        problems.add(f"--fp8-recipe {args.fp8_recipe}: {UNAVAILABLE[args.fp8_recipe]}; use --fp8-recipe "
                     f"{' or '.join(RECIPES)}")  # fmt: skip
    elif args.fp8_recipe not in RECIPES:
        problems.add(f"--fp8-recipe {args.fp8_recipe}: unknown; the recipes are {' and '.join(RECIPES)} (Megatron's "
                     f"{', '.join(UNAVAILABLE)} need Transformer Engine)")  # fmt: skip
    if not args.bf16:
        problems.add(f"--fp8-format {args.fp8_format} needs --bf16 (as in Megatron: the layers around the FP8 "
                     "products, and the weights FP8 is cast from, are bf16)")  # fmt: skip
    if args.fp8_param_gather and args.engine != "fsdp":
        problems.add("--fp8-param-gather all-gathers FSDP2's weight shards in FP8: it needs --engine fsdp")
    if args.fp8_param_gather and args.tensor_model_parallel_size > 1:
        problems.add(f"--fp8-param-gather with --tensor-model-parallel-size {args.tensor_model_parallel_size}: torchao's "
                     "float8 all-gather takes a weight's scale over the FSDP ranks, not over its tensor-parallel shards "
                     "(each rank would round its shard otherwise)")  # fmt: skip
    if args.fp8_param_gather and args.fp8_recipe != "tensorwise":
        problems.add(
            "--fp8-param-gather needs --fp8-recipe tensorwise (torchao's float8 all-gather scales whole tensors)"
        )
    missing = _torchao_problem()
    if missing:
        problems.add(f"--fp8-format: {missing}")


def tokens_problem(args: argparse.Namespace, seq_length: int | None) -> str | None:
    """Why a micro-batch's tokens (of ``seq_length``, and T5's decoder's) cannot feed the FP8 GEMM
    of a weight gradient, whose inner dimension they are: not a multiple of 16 (per
    context-parallel rank). ``None`` while the sequence length is not known yet."""
    lengths = {"": seq_length, " decoder": getattr(args, "decoder_seq_length", None)}
    for which, length in lengths.items():
        if args.fp8_format and length and args.micro_batch_size:
            tokens = args.micro_batch_size * length // args.context_parallel_size
            if tokens % 16:
                return (f"--fp8-format: a micro-batch's {tokens}{which} tokens (per context-parallel rank) are not a "
                        "multiple of 16, as the FP8 GEMM of the weight gradient needs")  # fmt: skip
    return None


def _torchao_problem() -> str | None:
    """Why torchao cannot serve FP8 here: not installed, or a version outside the supported range."""
    if installed_version("torchao") is None:
        return "FP8 runs on torchao, which is not installed (pip install -r requirements.txt)"
    try:
        check_versions(["torchao"])
    except UnsupportedVersionError as e:
        return str(e)
    return None


def fp8_recipe(args: argparse.Namespace, planned: bool = False) -> Fp8Recipe | None:
    """The run's FP8 recipe, or ``None`` without ``--fp8-format``: emulated on a CPU, refused on a GPU
    without FP8 matrix units (before anything is built). ``planned``: a run explain plans on meta
    tensors for the GPUs it will run on, never emulated."""
    if args.fp8_format is None:
        return None
    if planned or not torch.cuda.is_available():
        return Fp8Recipe(args.fp8_recipe, args.fp8_format, emulate=not planned)
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name()
        raise ConfigError(f"--fp8-format {args.fp8_format}: {name} (compute capability {capability[0]}.{capability[1]}) "
                          "has no FP8 matrix units, which need compute capability 8.9 or later (Ada, Hopper); "
                          "train with --bf16 alone")  # fmt: skip
    return Fp8Recipe(args.fp8_recipe, args.fp8_format)
