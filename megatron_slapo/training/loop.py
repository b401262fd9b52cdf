"""The pretraining loop behind ``pretrain_gpt.py`` and ``pretrain_bert.py``.

:func:`pretrain` does, in order: parse and validate arguments, start the process groups, check the
data (and the checkpoint to resume from), build the HF model on the meta device, apply the named
schedule, materialise this rank's shards, hand the model to the engine, and train: micro-batches
from a resumable sampler, one engine step per iteration, the Megatron log line, evaluation,
checkpoints. Every input problem it can detect is reported as one line before training starts.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch.distributed as dist

import megatron_slapo as ms
from megatron_slapo import parallel
from megatron_slapo.compat.transformers_internals import attn_implementation
from megatron_slapo.data import embedded
from megatron_slapo.data.datasets import Corpus, SplitSizes
from megatron_slapo.data.samplers import data_loader
from megatron_slapo.data.tokenizers import build_tokenizer
from megatron_slapo.engines import ENGINES
from megatron_slapo.engines.base import Engine, ModelShape
from megatron_slapo.errors import ConfigError
from megatron_slapo.kernels.compiled import compiler_problem
from megatron_slapo.models.layers import shared_layers, transformer_layers
from megatron_slapo.parallel import context
from megatron_slapo.parallel.agreement import agreed_errors
from megatron_slapo.parallel.comm_log import CommLog
from megatron_slapo.parallel.state import Layout
from megatron_slapo.pipeline import PipelineStages
from megatron_slapo.plans import context_parallel, sequence
from megatron_slapo.plans.expert_capacity import DROPPED, drops_tokens
from megatron_slapo.training import checkpointing, dist_checkpoint, error_report, recompute
from megatron_slapo.training.arguments import parse_args
from megatron_slapo.training.checkpointing import Resume
from megatron_slapo.training.exit_conditions import ExitConditions
from megatron_slapo.training.flops import device_peak_tflops, flops_per_image, flops_per_token
from megatron_slapo.training.model import (
    Vocabulary,
    auto_class,
    build_config,
    build_vision_config,
    check_attention_backend,
    create_model,
    megatron_shape,
    pipeline_cuts,
    pipeline_stages,
    tied_weights,
    trace_for_pipeline,
    vocab_parameter_names,
    vocabulary,
)
from megatron_slapo.training.moe_loss import load_balancing_loss
from megatron_slapo.training.output_paths import check_output_dir
from megatron_slapo.training.reporting import Reporter, log_engine_memory, tensorboard_dir
from megatron_slapo.training.settings import RunSettings, check_schedule, resolve_settings
from megatron_slapo.training.tasks import BERTTask, GPTTask, LanguageData, T5Task, VisionTask
from megatron_slapo.training.trainer_args import print_arguments
from megatron_slapo.training.validation import validate_args
from schedules import describe, get_schedule


class TrainingStopped(RuntimeError):
    """Training cannot go on (e.g. the loss diverged); the message says why."""


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
    recorded: dict[str, Any]  # the checkpoint's record of the arguments (Plan.recorded)
    started: float = 0.0  # time.time() at the start of setup: --exit-duration-in-mins counts from here


def print_rank_0(*values: Any) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*values, flush=True)


def _embedded_data(args: argparse.Namespace, task: str) -> embedded.EmbeddedData:
    """The embedded corpus (built by rank 0 if it is not cached yet), which a run without data flags
    trains on, and its tokenizer."""
    corpus = "gpt" if task == "gpt" else "bert"  # T5 masks BERT's sentences, tokenized alike
    cache = args.data_cache_path or os.path.join(os.path.expanduser("~"), ".cache", "megatron_slapo")
    if dist.get_rank() == 0:
        embedded.prepare(corpus, cache)
    dist.barrier()
    data = embedded.prepare(corpus, cache)
    print_rank_0(f"> no --data-path: training on the embedded corpus (Python's help topics) at {data.prefix}")
    if args.embedded_defaults:
        chosen = " ".join(f"--{k.replace('_', '-')} {v:g}" if isinstance(v, float) else f"--{k.replace('_', '-')} {v}"
                          for k, v in args.embedded_defaults.items())  # fmt: skip
        print_rank_0(f"> the embedded run's defaults for flags not given: {chosen}")
    return data


def _split_sizes(args: argparse.Namespace) -> SplitSizes:
    """Samples per split: every iteration, every validation (periodic + final), the final test pass."""
    gbs = args.global_batch_size
    evaluations = args.train_iters // args.eval_interval + 1 if args.eval_iters else 0
    return SplitSizes(args.train_iters * gbs, evaluations * args.eval_iters * gbs, args.eval_iters * gbs)


@dataclass
class Plan:
    """A run scheduled but not built (:func:`prepare`): what ``tools/explain.py`` reads, and what
    :func:`setup` materialises."""

    args: argparse.Namespace
    settings: RunSettings
    task: GPTTask | BERTTask | T5Task | VisionTask
    config: Any
    layout: Layout
    sch: Any  # the Schedule, on the meta device
    stages: int  # pipeline stages (virtual ones included)
    datasets: tuple
    model_class: str
    metadata_vocab: Any
    resume_path: str | None  # the checkpoint --load resumes from (not looked for when simulating)
    started: float
    vocab: Vocabulary | None  # None for an image model
    shape: ModelShape
    recorded: dict[str, Any]  # the arguments as the run uses them: the checkpoint's Megatron ``args``
    checkpoint: dict[str, Any] | None = None  # resume_path read and checked (torch_dist: its common state)
    tied: dict[str, str] = field(default_factory=dict)  # HF's tied weights: name -> the name it is tied to


def prepare(args: argparse.Namespace, world: int | None = None, simulate_rank: int | None = None) -> Plan:
    """Validate, start the process groups, schedule the meta model: everything before materialising.

    ``simulate_rank``: plan rank ``simulate_rank`` of ``world`` in this one process, over torch's
    fake process group (its collectives move nothing), as ``tools/explain.py`` does.
    """
    started = time.time()
    world = world or int(os.environ.get("WORLD_SIZE", 1))
    validate_args(args, world)
    check_attention_backend(args)
    settings, hf_config = resolve_settings(args)  # decided here, once: from now on `args` is only read
    print_arguments(argparse.Namespace(**settings.arguments(args)))
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    experts = dict(
        expert_parallel=args.expert_model_parallel_size,
        expert_tensor_parallel=args.expert_tensor_parallel_size,
        context_parallel=args.context_parallel_size,
    )
    if simulate_rank is None:
        parallel.initialize(tp, pp, seed=args.seed, timeout_minutes=args.distributed_timeout_minutes, **experts)
    else:
        parallel.simulate(world, simulate_rank, tp, pp, seed=args.seed, **experts)
    layout = Layout.current()
    resume_path = None  # the checkpoint --load resumes from (not looked for when simulating)
    if simulate_rank is None:  # what the run reads and writes, checked and agreed on by every rank before compute
        with agreed_errors(ConfigError):
            if args.tensorboard_dir:
                check_output_dir("--tensorboard-dir", args.tensorboard_dir)
            elif args.embedded_data or settings.task == "vision":  # the run names its own folder under runs/
                check_output_dir("--tensorboard-dir (default: under runs/)", "runs")
            resume_path = (checkpointing.checkpoint_file(args.load, layout, args.ckpt_format, args.auto_detect_ckpt_format)
                           if args.load else None)  # fmt: skip
            checkpointing.check_save_target(args, resume_path)
    tp_group = parallel.tensor_parallel_group()
    if settings.task == "vision":
        config, task, data = build_vision_config(args, hf_config), VisionTask(), None
    else:
        config, task, data = _language_task(args, settings, hf_config, tp_group)
    if not settings.schedule_given:  # the dump shows the schedule, not that the model type and TP chose it
        print_rank_0(f" > schedule: {settings.schedule} ({settings.schedule_reason})")
    schedule = get_schedule(settings.schedule)
    check_schedule(args, settings, config)  # an unverified family is refused here when it needs splitting
    checkpoint = None  # read and checked before anything is built (a collective: every rank, when --load is given)
    if args.load and simulate_rank is None:
        checkpoint = checkpointing.read_checked(args, layout, resume_path, config.num_hidden_layers)
    datasets = task.build_datasets(args, data, _split_sizes(args))
    model = create_model(args, settings.task, config)
    cp = context.current(args.cp_comm_type)  # None without --context-parallel-size
    if isinstance(task, GPTTask):
        task.attention = attn_implementation(model.config)  # the form of the 4D mask it takes
        task.load_balancing = load_balancing_loss(model, args, tp_group)  # an MoE model's auxiliary loss, when on
        task.context = cp
        if cp and task.load_balancing:
            raise ConfigError(f"--context-parallel-size {cp.size}: {config.model_type}'s config turns its auxiliary "
                              "load-balancing loss on, whose statistics span the whole sequence: not supported with "
                              "context parallelism")  # fmt: skip
    metadata_vocab, model_class = vocab_parameter_names(model), type(model).__name__
    sch = ms.create_schedule(model)
    if cp:  # first: a pipeline's trace runs the layers and records how the model builds its masks
        context_parallel.split_attention(sch, cp)
    stages = pipeline_stages(args, config.num_hidden_layers)
    recomputing = args.recompute_granularity is not None or args.checkpoint_ratio is not None
    needs_layers = stages > 1 or recomputing or args.sequence_parallel or args.compile
    layers = _layers(args, model, config.num_hidden_layers, stages) if needs_layers else []
    if stages > 1:
        trace_for_pipeline(sch, task, args, layers, settings.seq_length)
    schedule.apply(sch, config, args)
    shards = any(node.metadata.shards for _, node in sch.named_schedules())
    if getattr(args, "moe_expert_capacity_factor", None) is not None and not drops_tokens(model):
        raise ConfigError(f"--moe-expert-capacity-factor: --schedule {settings.schedule} placed no experts to limit "
                          "(a dense model, or a schedule that does not place them: MoE models take --schedule auto)")  # fmt: skip
    if args.expert_model_parallel_size > 1 and not any(n.metadata.expert_shards for _, n in sch.named_schedules()):
        raise ConfigError(f"--expert-model-parallel-size {args.expert_model_parallel_size}: --schedule "
                          f"{settings.schedule} placed no experts on the expert-parallel ranks (a dense model, or a "
                          "schedule without expert parallelism: MoE models take --schedule auto)")  # fmt: skip
    if layout.tp_size > 1 and not shards:
        raise ConfigError(
            f"--schedule {settings.schedule} shards nothing, but --tensor-model-parallel-size is {layout.tp_size}; "
            "use a tensor-parallel schedule (see --schedule list)"
        )
    if args.sequence_parallel and settings.task != "vision":  # an image model's schedule splits the batch itself
        sequence.split_layers(sch, layers)
    if recomputing:
        depths = config.num_hidden_layers if shared_layers(model) else None  # ALBERT: one layer, several depths
        print_rank_0(recompute.apply(sch, args, layers, stages, depths))
    if args.compile:
        for path in layers:
            if not sch[path].metadata.compiled:  # a schedule may compile its layers itself (gpt_fused)
                sch[path].compile()
    backends = {node.metadata.compiled for _, node in sch.named_schedules()} - {None}
    if backends:
        why = "--compile" if args.compile else f"--schedule {settings.schedule} compiles its layers"
        if cp:
            raise ConfigError(f"{why} with --context-parallel-size {cp.size}: torch.compile does not trace the "
                              "context-parallel ring's exchanges yet; run the layers eagerly")  # fmt: skip
        problems = [problem for problem in map(compiler_problem, sorted(backends)) if problem]
        if problems:
            raise ConfigError(f"{why}: {problems[0]}")
        count = sum(1 for _, node in sch.named_schedules() if node.metadata.compiled)
        print_rank_0(f"> torch.compile ({', '.join(sorted(backends))}): {count} modules, compiled on first use")
        if args.engine == "deepspeed" and args.zero_stage == 3:  # exact, but compiled in pieces
            print_rank_0("> note: ZeRO-3 gathers each submodule's weights in hooks that torch.compile skips, so "
                         "each compiled layer runs as the pieces between them; FSDP (--engine fsdp) gathers "
                         "per layer and keeps it whole")  # fmt: skip
    for path in pipeline_cuts(config, layers, stages):
        sch[path].cut_pipeline_stage()
    if layout.tp_size == 1 and shards and world > 1:
        ranks = f"{args.data_parallel_size} data-parallel" + (
            f" x {layout.pp_size} pipeline" if layout.pp_size > 1 else ""
        )
        print_rank_0(f" > note: --schedule {settings.schedule} shards over --tensor-model-parallel-size 1, i.e. not at "
                     f"all; the {world} ranks are {ranks} ranks")  # fmt: skip
    shape = megatron_shape(config, tp)
    recorded = {**settings.arguments(args), **(data.arguments() if data else {}), **asdict(shape)}
    return Plan(args, settings, task, config, layout, sch, stages, datasets, model_class, metadata_vocab, resume_path,
                started, data.vocab if data else None, shape, recorded, checkpoint, tied_weights(model))  # fmt: skip


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
    log_engine_memory(engine.memory_report(), (layout.tp_rank, layout.pp_rank, layout.dp_rank))
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
    reporter = Reporter(args, flops * per_iteration, per_iteration, device_peak_tflops(args.peak_tflops), unit,
                        tensorboard_dir(args, settings, plan.shape, layout))  # fmt: skip
    return Run(args, settings, task, engine, layout, resume, plan.datasets, reporter, metadata, plan.recorded,
               plan.started)  # fmt: skip


def _language_task(args: argparse.Namespace, settings: RunSettings, hf_config: Any,
                   tp_group: Any) -> tuple[Any, GPTTask | BERTTask | T5Task, LanguageData]:  # fmt: skip
    """The config, task and data of pretrain_gpt.py / pretrain_bert.py / pretrain_t5.py: the
    tokenizer and data of the flags, or the embedded corpus when no data is given."""
    data = _embedded_data(args, settings.task) if args.embedded_data else None
    flags = (args.tokenizer_type, args.vocab_file, args.merge_file)
    files = (data.tokenizer_type, data.vocab_file, data.merge_file) if data else flags
    tokenizer = build_tokenizer(*files, args.tokenizer_model, args.vocab_size, getattr(args, "vocab_extra_ids", 0))
    vocab = vocabulary(args, tokenizer, hf_config)
    config = build_config(args, tokenizer, hf_config, shared_kv_heads=settings.schedule == "auto")
    seq_length = settings.seq_length
    if args.sequence_parallel and seq_length % args.tensor_model_parallel_size:
        raise ConfigError(f"--sequence-parallel splits the sequence: --seq-length {seq_length} is not "
                          f"divisible by --tensor-model-parallel-size {args.tensor_model_parallel_size}")  # fmt: skip
    print_rank_0(
        f"> padded vocab (size: {vocab.true_size}) with {vocab.padded_size - vocab.true_size} "
        f"dummy tokens (new size: {vocab.padded_size})"
    )
    if settings.task == "gpt":
        eod = getattr(tokenizer, "eod", None)
        task: GPTTask | BERTTask | T5Task = GPTTask(vocab.padded_size, tp_group, args.reset_position_ids,
                                                    args.reset_attention_mask, eod)  # fmt: skip
    elif settings.task == "t5":
        task = T5Task(vocab.padded_size, tp_group)
    else:
        task = BERTTask(vocab.padded_size, tp_group, args.bert_binary_head)
    named = f"model in --load-hf {args.load_hf}" if args.load_hf else f"tokenizer ({files[0]})"
    corpus = Corpus([data.prefix] if data else args.data_path, seq_length, vocab.true_size, named)
    return config, task, LanguageData(tokenizer, vocab, corpus, data)


def _layers(args: argparse.Namespace, model: Any, num_layers: int, stages: int) -> list[str]:
    """The transformer layers to cut, split or recompute. A model that runs one layer at several
    depths (ALBERT) has no module per depth: recomputing it recomputes every use, but a pipeline
    cut, a sequence split at the first layer, or recomputing only some depths cannot be placed."""
    shared = shared_layers(model)
    if not shared:
        return transformer_layers(model, num_layers)
    partial = args.checkpoint_ratio is not None or (
        args.recompute_granularity == "full" and args.recompute_method == "block"
    )
    for wanted, flag in ((stages > 1, "--pipeline-model-parallel-size > 1"), (args.sequence_parallel,
                         "--sequence-parallel"), (partial, "--recompute-method block / --checkpoint-ratio")):  # fmt: skip
        if wanted:
            raise ConfigError(f"{type(model).__name__} runs {len(shared)} shared layer(s) at all {num_layers} depths: "
                              f"{flag} needs a module per depth (recompute with --recompute-method uniform or "
                              "--recompute-granularity selective)")  # fmt: skip
    return shared


def _batches(loader) -> Iterator:
    while True:  # datasets are sized for the whole run; cycling only guards against rounding
        yield from loader


def evaluate(run: Run, batches: Iterator, iterations: int, num_microbatches: int) -> dict[str, float]:
    totals: dict[str, float] = {}
    for _ in range(iterations):
        metrics = run.engine.eval_step([next(batches) for _ in range(num_microbatches)], run.task)
        for k, v in metrics.items():
            totals[k] = totals.get(k, 0.0) + v
    return {k: v / iterations for k, v in totals.items()}


def train(run: Run) -> Resume:
    """Train from ``run.resume`` to ``--train-iters`` (or ``--exit-interval``); return where it stopped."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches, init_num_microbatches_calculator
    from megatron.core.timers import Timers

    args, layout, state = run.args, run.layout, run.resume
    init_num_microbatches_calculator(
        dist.get_rank(), None, args.global_batch_size, args.micro_batch_size, args.data_parallel_size
    )
    n_micro = get_num_microbatches()
    dp_rank, dp_size = layout.data_rank, args.data_parallel_size
    train_set, valid_set, test_set = run.datasets
    loader = data_loader(
        train_set, state.consumed_train_samples, args.micro_batch_size, dp_rank, dp_size, args.num_workers
    )
    train_batches = _batches(loader)
    valid_batches = None
    if valid_set is not None and args.eval_iters:
        valid_loader = data_loader(valid_set, state.consumed_valid_samples, args.micro_batch_size, dp_rank, dp_size,
                                   args.num_workers)  # fmt: skip
        valid_batches = _batches(valid_loader)
    if state.iteration >= args.train_iters:  # e.g. a finished run loaded again: Megatron trains nothing either
        print_rank_0(f"> nothing to train: the checkpoint is at iteration {state.iteration}, "
                     f"--train-iters is {args.train_iters} (raise it to train further)")  # fmt: skip
    else:
        print_rank_0(
            f"> training from iteration {state.iteration} to {args.train_iters} ({n_micro} micro-batches per step)"
        )
    timers = Timers(log_level=0, log_option="minmax")
    comm = CommLog().install() if args.log_comm else None
    try:
        with ExitConditions(args.exit_duration_in_mins, args.exit_signal_handler, run.started) as exits:
            state = _loop(run, timers, comm, exits, train_batches, valid_batches, n_micro)
    finally:
        if comm:
            comm.uninstall()
    if state.iteration >= args.train_iters and args.eval_iters:  # as Megatron, not after an early exit
        _evaluate_at_end(run, valid_batches, test_set, n_micro)
    return state


def _evaluate_at_end(run: Run, valid_batches: Iterator | None, test_set: Any, n_micro: int) -> None:
    """Megatron's final passes: the validation split, then the test split (from its first sample)."""
    args, state = run.args, run.resume
    if valid_batches:
        metrics = evaluate(run, valid_batches, args.eval_iters, n_micro)
        run.reporter.validation(state.iteration, state.consumed_train_samples, metrics, at_end=True)
    if test_set is None:
        print_rank_0(f" > no test evaluation: --split {args.split} leaves the test split no documents")
        return
    test_loader = data_loader(test_set, 0, args.micro_batch_size, run.layout.data_rank, args.data_parallel_size, 0)
    metrics = evaluate(run, _batches(test_loader), args.eval_iters, n_micro)
    run.reporter.validation(state.iteration, state.consumed_train_samples, metrics, at_end=True, split="test")


def _loop(run: Run, timers: Any, comm: CommLog | None, exits: ExitConditions, train_batches: Iterator,
          valid_batches: Iterator | None, n_micro: int) -> Resume:  # fmt: skip
    args, layout, state = run.args, run.layout, run.resume
    saved_at = state.iteration if args.load else None
    nan_streak = 0
    saves = dist_checkpoint.AsyncSaves() if args.async_save else None  # committed between steps once written
    while state.iteration < args.train_iters:
        micro = [next(train_batches) for _ in range(n_micro)]
        if comm:
            comm.take()  # evaluation and checkpoints are not part of the step
        timers("train-step", log_level=0).start()
        with run.reporter.measure_memory(run.engine, len(micro)):  # the first step's, logged at reporter.step
            result = run.engine.train_step(micro, run.task)
        timers("train-step").stop()
        if getattr(args, "moe_expert_capacity_factor", None) is not None:  # a collective: before --log-comm's count
            result.metrics["moe dropped tokens (fraction)"] = DROPPED.take_fraction()
        if comm:
            result.comm = comm.take()
        state.iteration += 1
        state.consumed_train_samples += args.global_batch_size
        if saves and state.iteration % args.log_interval == 0:  # an all-reduce: not every step
            saves.poll()
        if args.log_timers_to_tensorboard and state.iteration % args.tensorboard_log_interval == 0:
            # a collective (max over ranks): every rank calls it, at TensorBoard's interval only
            timers.write(["train-step"], run.reporter.writer, state.iteration, reset=False)
        seconds = timers("train-step").elapsed()
        run.reporter.step(state.iteration, state.consumed_train_samples, result, seconds)
        nan_streak = nan_streak + 1 if result.diverging else 0
        if nan_streak >= args.max_consecutive_nan_iterations:
            raise TrainingStopped(
                f"stopping at iteration {state.iteration}: {nan_streak} consecutive iterations had a NaN/inf loss "
                "or gradient (try a lower --lr or --clip-grad, or --bf16 instead of --fp16)"
            )
        if valid_batches and args.eval_interval and state.iteration % args.eval_interval == 0:
            metrics = evaluate(run, valid_batches, args.eval_iters, n_micro)
            state.consumed_valid_samples += args.eval_iters * args.global_batch_size
            run.reporter.validation(state.iteration, state.consumed_train_samples, metrics)
        if args.save and args.save_interval and state.iteration % args.save_interval == 0:
            checkpointing.save(run.engine, args, layout, state, run.metadata, run.recorded, saves)
            saved_at = state.iteration
        reason = exits.check()  # a collective when --exit-duration-in-mins / --exit-signal-handler is given
        if not reason and args.exit_interval and state.iteration % args.exit_interval == 0:
            reason = f"exiting program at iteration {state.iteration} (--exit-interval)"
        if reason:
            print_rank_0(reason)
            break
    if args.save and saved_at != state.iteration:
        checkpointing.save(run.engine, args, layout, state, run.metadata, run.recorded, saves)
    if saves:
        saves.wait()  # the last one is on disk and committed before the run ends
    return state


def main(task: str) -> None:
    """``pretrain_<task>.py``'s entry point: :func:`pretrain`, then, when it finished, the process
    groups shut down before the interpreter does (left to its exit, gloo's threads can be torn down
    mid-flight and abort a finished run). Not after an error: a rank would wait there for peers
    that never come, where exiting lets torchrun stop the job. An error's line (or a bug's
    traceback) goes to torchrun's failure summary as well."""
    with error_report.root_cause():
        pretrain(task)
    parallel.destroy()


def pretrain(task: str, argv: list[str] | None = None) -> Resume | None:
    """Entry point of ``pretrain_{task}.py``; returns where training stopped (for tests). Bad input
    and a peer rank's death end it with one line (:mod:`~megatron_slapo.training.error_report`)."""
    prog = f"pretrain_{task}.py"
    with error_report.user_errors(prog):
        args = parse_args(task, argv)
    if args.schedule == "list":
        print(describe())
        return None
    with error_report.user_errors(prog), error_report.lost_peers(prog):
        run = setup(args)
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator

    try:
        with error_report.lost_peers(prog):
            return train(run)
    except TrainingStopped as e:
        error_report.report(prog, str(e))
        sys.exit(1)
    finally:
        run.reporter.close()
        destroy_num_microbatches_calculator()
