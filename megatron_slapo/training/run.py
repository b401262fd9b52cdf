"""Setting a run up: the :class:`~megatron_slapo.training.plan.Plan` materialised. :func:`setup`
builds this rank's shards, hands them to the engine, loads the checkpoint to resume from and
starts the reporter (the log line's FLOPs, TensorBoard: a resumed run's goes on in the folder of
the run it resumes); :class:`Run` is what the training loop, the tuner's trials and the benchmarks
step.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

import megatron_slapo as ms
from megatron_slapo import parallel
from megatron_slapo.checkpoints import checkpointing
from megatron_slapo.checkpoints.checkpointing import Resume
from megatron_slapo.checkpoints.saved_model import SavedModel
from megatron_slapo.engines import ENGINES
from megatron_slapo.engines.base import Engine
from megatron_slapo.parallel.state import Layout
from megatron_slapo.pipeline import PipelineStages
from megatron_slapo.training.flops import device_peak_tflops, flops_per_image, flops_per_token
from megatron_slapo.training.model import auto_class
from megatron_slapo.training.plan import Plan, prepare
from megatron_slapo.training.reporting import Reporter, log_engine_memory, print_rank_0, tensorboard_dir
from megatron_slapo.training.settings import RunSettings
from megatron_slapo.training.tasks import BERTTask, GPTTask, T5Task, VisionTask


@dataclass
class Run:
    """Everything :func:`train` needs, assembled by :func:`setup`."""

    args: argparse.Namespace
    settings: RunSettings
    task: GPTTask | BERTTask | T5Task | VisionTask
    engine: Engine
    layout: Layout
    resume: Resume
    datasets: tuple
    reporter: Reporter
    metadata: dict
    recorded: dict[str, Any]  # the checkpoint's record of the arguments: Plan.recorded, the TensorBoard folder
    started: float = 0.0  # time.time() at the start of setup: --exit-duration-in-mins counts from here


def setup(args: argparse.Namespace) -> Run:
    """Validate, initialise, build: everything before the first training step."""
    plan = prepare(args)
    args, layout, task, config, stages, sch = plan.args, plan.layout, plan.task, plan.config, plan.stages, plan.sch
    tp_group, resume_path = parallel.tensor_parallel_group(), plan.resume_path
    local_stages = [k for k in range(stages) if k % layout.pp_size == layout.pp_rank]
    hook = getattr(ENGINES[args.engine], "build_hook", None)
    after_unit = hook(args, layout.dp_group, tp_group) if hook else None  # e.g. ZeRO-3 partitions as it builds
    model = ms.build(sch, seed=args.seed, stages=local_stages, recompute_pipeline_inputs=True, after_unit=after_unit)
    local = model.local(layout.pp_rank, layout.pp_size) if isinstance(model, PipelineStages) else [(0, model)]
    tensors = {k: v for _, stage in local for k, v in stage.state_dict(keep_vars=True).items()}
    unique = {id(p): p for _, stage in local for p in stage.parameters()}.values()
    count = sum(getattr(p, "ds_numel", p.numel()) for p in unique)  # a ZeRO-3 parameter knows its full size
    if layout.dp_rank == 0:
        where = f"({layout.tp_rank}, {layout.pp_rank})"
        print(f" > number of parameters on (tensor, pipeline) model parallel rank {where}: {count}", flush=True)
    settings = plan.settings
    metadata = checkpointing.export_metadata(tensors, plan.model_class, settings.task, config, plan.vocab,
                                             plan.metadata_vocab, args.tensor_model_parallel_size, plan.tied)  # fmt: skip
    engine = ENGINES[args.engine](model, args, layout.dp_group, tp_group, plan.shape)
    log_engine_memory(engine.memory_report(), layout)
    if args.bf16 or args.fp16:
        dtype = "bf16" if args.bf16 else "fp16"
        print_rank_0(f"> --{dtype} on --engine {args.engine}: {engine.MIXED_PRECISION[dtype]}")
    resume = Resume()
    if resume_path:
        resume = checkpointing.load(engine, args, layout, resume_path, plan.checkpoint, metadata)
        print_rank_0(f" > loaded checkpoint {resume_path} at iteration {resume.iteration}")
    elif args.load:
        print_rank_0(
            f" > WARNING: no checkpoint in {args.load} yet ({checkpointing.LATEST} not found): starting from scratch"
        )
    auto = auto_class(settings.task, getattr(args, "bert_binary_head", False))
    if isinstance(task, VisionTask):  # model FLOPs for the log line's TFLOP/s and MFU
        unit, per_iteration = "samples", args.global_batch_size
        flops = flops_per_image(auto, config, args.img_h, args.img_w)
    else:
        unit, per_iteration = "tokens", args.global_batch_size * settings.seq_length
        flops = flops_per_token(auto, config, settings.seq_length, getattr(args, "decoder_seq_length", None))
    tensorboard = _tensorboard(plan, resume)
    peak = device_peak_tflops(args.peak_tflops)
    reporter = Reporter(args, flops * per_iteration, per_iteration, peak, unit, tensorboard)
    recorded = {**plan.recorded, "tensorboard_dir": os.path.abspath(tensorboard) if tensorboard else None}
    return Run(args, settings, task, engine, layout, resume, plan.datasets, reporter, metadata, recorded,
               plan.started)  # fmt: skip


def _tensorboard(plan: Plan, resume: Resume) -> str | None:
    """This run's TensorBoard folder (:func:`tensorboard_dir`), the one a resumed run's checkpoint
    records among its arguments when there is one. The last rank, which writes there, decides, so
    that every rank records the same folder (a new one's name has the time in it)."""
    args = plan.args
    recorded = SavedModel.of(plan.resume_path or "", plan.checkpoint).args if resume.iteration and plan.checkpoint else {}
    chosen = [tensorboard_dir(args, plan.settings, plan.shape, plan.layout, recorded.get("tensorboard_dir"))]
    dist.broadcast_object_list(chosen, src=dist.get_world_size() - 1)
    return chosen[0]
