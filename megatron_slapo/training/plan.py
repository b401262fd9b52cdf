"""Planning a run: everything before anything is materialised.

:func:`prepare` validates the arguments, starts the process groups (or simulates one rank of a
world, for ``tools/explain.py``), checks what the run reads and writes, builds the HF model on the
meta device and applies the schedule, the layout's primitives (context parallelism, sequence
splits, recompute, compilation, pipeline cuts) and the refusals only a scheduled model can make.
The :class:`Plan` it returns is what explain and the tuner read; :mod:`.run` materialises it.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch.distributed as dist

import megatron_slapo as ms
from megatron_slapo import parallel
from megatron_slapo.arguments.checkpoint_args import take_model_flags
from megatron_slapo.arguments.fp8_flags import fp8_recipe, tokens_problem
from megatron_slapo.arguments.output_paths import check_output_dir
from megatron_slapo.arguments.trainer_args import print_arguments
from megatron_slapo.arguments.validation import validate_args
from megatron_slapo.checkpoints import checkpointing
from megatron_slapo.compat.transformers_internals import attn_implementation
from megatron_slapo.data import embedded
from megatron_slapo.data.datasets import Corpus, SplitSizes
from megatron_slapo.data.tokenizers import build_tokenizer
from megatron_slapo.engines.base import ModelShape
from megatron_slapo.errors import ConfigError
from megatron_slapo.kernels.compiled import compiler_problem
from megatron_slapo.models.layers import shared_layers, transformer_layers
from megatron_slapo.models.vocabulary import Vocabulary, tied_weights, vocab_parameter_names, vocabulary
from megatron_slapo.parallel import context
from megatron_slapo.parallel.agreement import agreed_errors
from megatron_slapo.parallel.state import Layout
from megatron_slapo.plans import context_parallel, fp8, sequence
from megatron_slapo.plans.expert_capacity import drops_tokens
from megatron_slapo.training import recompute
from megatron_slapo.training.model import (
    build_config,
    build_vision_config,
    check_attention_backend,
    create_model,
    megatron_shape,
    pipeline_cuts,
    pipeline_stages,
    trace_for_pipeline,
)
from megatron_slapo.training.moe_loss import load_balancing_loss
from megatron_slapo.training.reporting import print_rank_0
from megatron_slapo.training.settings import RunSettings, check_schedule, resolve_settings
from megatron_slapo.training.tasks import BERTTask, GPTTask, LanguageData, T5Task, VisionTask
from schedules import get_schedule


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


def take_checkpoint_args(args: argparse.Namespace) -> None:
    """The flags shaping the model that ``args`` was not given, from the checkpoint in ``--load``
    (:mod:`~megatron_slapo.arguments.checkpoint_args`), before they are validated; with
    ``--use-checkpoint-args``, a ``--load`` holding no checkpoint is refused."""
    if not args.load:
        return
    saved = checkpointing.read_saved_model(args.load)
    if saved is None:
        if args.use_checkpoint_args:
            raise ConfigError(f"--use-checkpoint-args: --load {args.load} holds no checkpoint to take the model's "
                              "flags from: give the size flags, or another --load")  # fmt: skip
        return
    taken = take_model_flags(args, saved.args, args.load)
    if taken and int(os.environ.get("RANK", 0)) == 0:  # before the process groups start
        print(f" > the model's flags from the checkpoint in --load {args.load}: {' '.join(taken)}", flush=True)


def _check_loadable(args: argparse.Namespace, task: str, config: Any) -> None:
    """Refuse, as the run would when it reads and loads it, the checkpoint in ``--load`` when it
    holds another model than ``config``'s: its family, depth and heads, and its tensors' shapes
    (those of the model built on the meta device here, before the data, as the run reads it)."""
    model = create_model(argparse.Namespace(**{**vars(args), "load_hf": None}), task, config)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    names = {"tied": tied_weights(model), "vocab": {"params": vocab_parameter_names(model)}}
    checkpointing.check_loadable(args.load, config, shapes, names)


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
    take_checkpoint_args(args)
    validate_args(args, world)
    check_attention_backend(args)
    settings, hf_config = resolve_settings(args)  # decided here, once: from now on `args` is only read
    recipe = fp8_recipe(args, planned=simulate_rank is not None)  # a GPU without FP8 units: refused here
    problem = tokens_problem(args, settings.seq_length)  # the sequence length a model's positions gave
    if problem:
        raise ConfigError(problem)
    print_arguments(argparse.Namespace(**settings.arguments(args)))
    tp = args.tensor_model_parallel_size
    start_groups(args, world, simulate_rank)
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
        config, task, data = language_task(args, settings, hf_config, tp_group)
    if not settings.schedule_given:  # the dump shows the schedule, not that the model type and TP chose it
        print_rank_0(f" > schedule: {settings.schedule} ({settings.schedule_reason})")
    schedule = get_schedule(settings.schedule)
    check_schedule(args, settings, config)  # an unverified family is refused here when it needs splitting
    checkpoint = None  # read and checked before anything is built (a collective: every rank, when --load is given)
    if args.load and simulate_rank is None:
        checkpoint = checkpointing.read_checked(args, layout, resume_path, config)
    elif args.load:  # explain: the checkpoint the run would load, checked as the run checks it
        _check_loadable(args, settings.task, config)
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
    if recipe:  # after the schedule: a split layer agrees its scales over the ranks its role says
        blocks = shared_layers(model) or transformer_layers(model, config.num_hidden_layers)  # ALBERT's: shared
        print_rank_0(fp8.apply(sch, recipe, blocks, cp.group if cp else None))
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
        print_rank_0(f" > note: --schedule {settings.schedule} shards over --tensor-model-parallel-size 1, i.e. not at "
                     f"all; the {world} ranks are {describe_ranks(args)}")  # fmt: skip
    shape = megatron_shape(config, tp)
    recorded = {**settings.arguments(args), **(data.arguments() if data else {}), **asdict(shape)}
    return Plan(args, settings, task, config, layout, sch, stages, datasets, model_class, metadata_vocab, resume_path,
                started, data.vocab if data else None, shape, recorded, checkpoint, tied_weights(model))  # fmt: skip


def start_groups(args: argparse.Namespace, world: int, simulate_rank: int | None = None) -> None:
    """Start the process groups of the layout ``args`` give (checked by :func:`validate_args`):
    this process's rank of the run, or rank ``simulate_rank`` of ``world`` over torch's fake group."""
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


def describe_ranks(args: argparse.Namespace) -> str:
    """What the ranks of a run without tensor parallelism are, for the start-up note: data-parallel,
    context-parallel (which read the same batches) and pipeline ranks, and the expert-parallel
    split carved out of the data-parallel ones."""
    ranks = [f"{args.data_parallel_size} data-parallel"]
    if args.context_parallel_size > 1:
        ranks.append(f"{args.context_parallel_size} context-parallel")
    if args.pipeline_model_parallel_size > 1:
        ranks.append(f"{args.pipeline_model_parallel_size} pipeline")
    described = " x ".join(ranks) + " ranks"
    ep = args.expert_model_parallel_size
    if ep > 1:
        described += f", the routed experts split over {ep} expert-parallel ranks out of the data-parallel ones"
    return described


def language_task(args: argparse.Namespace, settings: RunSettings, hf_config: Any,
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
