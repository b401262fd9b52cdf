"""ZeRO data parallelism (stages 0-3) with DeepSpeed, under the scheduled model's tensor parallelism.

DeepSpeed learns the layout from an ``mpu`` object (:class:`_MPU`): ZeRO partitions optimizer
state, gradients (stage 2) and weights (stage 3) across the data-parallel group only, and gradient
clipping counts each tensor-parallel shard once. The optimizer is our AdamW (torch's, so nothing is
JIT-compiled) handed to DeepSpeed as a client optimizer, and the LR follows megatron-core's
``OptimizerParamScheduler`` exactly as with ``--engine ddp``: the same flags give the same run.

Checkpoints: DeepSpeed's own files (ZeRO partitions, one per data-parallel rank) go into
``iter_XXXXXXX/deepspeed/``; ``model_optim_rng.pt`` still holds the full fp32 weights of the TP rank
(gathered from the ZeRO partitions), so ``tools/convert_checkpoint.py`` and ``--finetune`` work
whatever engine wrote the checkpoint. ``--ckpt-format torch_dist`` stores instead what each rank
holds, its ZeRO partitions, under the tensors' global names (:mod:`megatron_slapo.engines.deepspeed_state`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from megatron_slapo.compat.deepspeed_internals import convert_to_zero_parameters, skip_shm_op_build
from megatron_slapo.compat.versions import UnsupportedVersionError, check_versions
from megatron_slapo.engines.base import (
    Batch,
    ModelShape,
    StepResult,
    Task,
    accumulate,
    average_metrics,
    evaluate,
    tensor_bytes,
    to_device,
)
from megatron_slapo.engines.deepspeed_state import DeepSpeedState
from megatron_slapo.engines.optimizer import build_optimizer, build_scheduler, global_norm, half_precision, local_part
from megatron_slapo.engines.sharded_state import EngineState, Fill
from megatron_slapo.errors import CheckpointError, ConfigError
from megatron_slapo.parallel.collectives import (
    Group,
    group_rank,
    group_size,
    reduce_sequence_parallel_grads_in_backward,
)

TAG = "deepspeed"  # the sub-directory of an iteration that holds DeepSpeed's files
# Keys that Megatron flags own; a --deepspeed-config giving them differently is refused.
_OWNED = {"optimizer": "--lr, --adam-*, --weight-decay", "scheduler": "--lr-decay-style, --lr-warmup-*"}


class _MPU:
    """DeepSpeed's view of model parallelism: "model parallel" is our tensor parallelism."""

    def __init__(self, dp_group: Group, tp_group: Group) -> None:
        """Answer DeepSpeed's questions from our groups."""
        self.dp_group, self.tp_group = dp_group, tp_group

    def get_model_parallel_rank(self) -> int:
        """This rank's place in the tensor-parallel group."""
        return group_rank(self.tp_group)

    def get_model_parallel_world_size(self) -> int:
        """The tensor-parallel size."""
        return group_size(self.tp_group)

    def get_model_parallel_group(self) -> Group:
        """The tensor-parallel group (DeepSpeed's clipping sums norms over it)."""
        return self.tp_group

    def get_data_parallel_rank(self) -> int:
        """This rank's place in the data-parallel group."""
        return group_rank(self.dp_group)

    def get_data_parallel_world_size(self) -> int:
        """The data-parallel size (ZeRO partitions over it)."""
        return group_size(self.dp_group)

    def get_data_parallel_group(self) -> Group:
        """The data-parallel group."""
        return self.dp_group


def _import_deepspeed() -> Any:
    """Import DeepSpeed without its shared-memory collective op, which would JIT-compile on CPU (~30 s),
    after refusing a version outside the supported range (checked here: only this engine uses it)."""
    try:
        check_versions(["deepspeed"])
    except UnsupportedVersionError as e:
        raise ConfigError(f"--engine deepspeed: {e}") from e
    import deepspeed

    # DeepSpeed 0.19 calls collectives that torch 2.13 renamed; the warning is not actionable here.
    warnings.filterwarnings("ignore", r"`torch\.distributed\.\w+` is deprecated", FutureWarning)
    if not torch.cuda.is_available():
        skip_shm_op_build()
    return deepspeed


def deepspeed_config(args: argparse.Namespace, dp_size: int) -> dict[str, Any]:
    """The DeepSpeed config: ``--deepspeed-config`` (if any) completed from, and checked against, the flags."""
    config: dict[str, Any] = {}
    if args.deepspeed_config:
        try:
            with open(args.deepspeed_config) as f:
                config = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read --deepspeed-config {args.deepspeed_config}: {e}") from e
        if not isinstance(config, dict):
            raise ConfigError(f"--deepspeed-config {args.deepspeed_config} must hold a JSON object")
    for key, flags in _OWNED.items():
        if key in config:
            raise ConfigError(f"--deepspeed-config sets {key!r}; the {key} comes from the Megatron flags ({flags})")
    accumulation = args.global_batch_size // (args.micro_batch_size * dp_size)
    wanted = {
        "train_batch_size": args.global_batch_size,
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "gradient_accumulation_steps": accumulation,
    }
    zero = config.setdefault("zero_optimization", {})
    stage = zero.get("stage")
    if args.zero_stage is not None and stage not in (None, args.zero_stage):
        raise ConfigError(f"--zero-stage {args.zero_stage} contradicts stage {stage} in --deepspeed-config")
    zero["stage"] = args.zero_stage if args.zero_stage is not None else stage if stage is not None else 1
    for key, value in wanted.items():
        if config.get(key, value) != value:
            raise ConfigError(f"--deepspeed-config has {key}={config[key]}, but the batch flags give {value}")
        config[key] = value
    # Explicit, always: DeepSpeed 0.19 would otherwise clip to norm 1.0 whatever --clip-grad says.
    if config.setdefault("gradient_clipping", args.clip_grad) != args.clip_grad:
        raise ConfigError(
            f"--deepspeed-config has gradient_clipping={config['gradient_clipping']}, but --clip-grad is "
            f"{args.clip_grad}; pass --clip-grad {config['gradient_clipping']}"
        )
    for precision, flag in (("fp16", args.fp16), ("bf16", args.bf16)):
        if flag:  # the flag alone is enough; a JSON section only refines it
            config.setdefault(precision, {}).setdefault("enabled", True)
        enabled = config.get(precision, {}).get("enabled", False)
        if enabled != flag:
            what = f"--deepspeed-config has {precision} enabled={enabled}"
            raise ConfigError(
                f"{what}; pass --{precision} to match" if enabled else f"{what}, but --{precision} is given"
            )
    if args.fp16:
        fp16 = config["fp16"]
        fp16.setdefault("loss_scale", args.loss_scale or 0)  # 0: dynamic
        fp16.setdefault("initial_scale_power", int(math.log2(args.initial_loss_scale)))
        fp16.setdefault("loss_scale_window", args.loss_scale_window)
        fp16.setdefault("hysteresis", args.hysteresis)
        fp16.setdefault("min_loss_scale", args.min_loss_scale)
    config.setdefault("steps_per_print", 2**31)  # the trainer prints its own log line
    return config


def _check_precision_supported(config: dict[str, Any]) -> None:
    """DeepSpeed's CPU accelerator has no fp16 path: say so before the model is built, not in initialize."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    for precision, supported in (("fp16", accelerator.is_fp16_supported), ("bf16", accelerator.is_bf16_supported)):
        if config.get(precision, {}).get("enabled", False) and not supported():
            raise ConfigError(
                f"--engine deepspeed cannot train in {precision} on {accelerator.device_name()}: DeepSpeed does not "
                "support it there; use --bf16, or --engine megatron/fsdp/ddp for --fp16"
            )


def zero_state(stage: int, local_weight_bytes: int, weight_bytes: int, master_numel: int, half: bool) -> dict[str, int]:
    """Bytes under ZeRO ``stage``: the weights stored here (``local_weight_bytes``: ZeRO-3's
    partition, else all ``weight_bytes``); the gradients, a partition of fp32 ones from stage 2,
    else all in the weights' dtype; AdamW's two fp32 moments over the optimizer's ``master_numel``
    elements, and from stage 1 an fp32 master copy of them, except under ZeRO-3 with fp32 weights
    (``half`` False), where DeepSpeed 0.19 steps its partition of the weights in place
    (``stage3.py``'s ``_create_fp32_partitions``). :meth:`DeepSpeedEngine.memory_report`'s, and
    ``tools/explain.py``'s; tests/distributed/test_explain.py checks both against the real tensors."""
    master = 4 * master_numel
    copies = 3 if stage >= 1 and (half or stage < 3) else 2
    return {"params": local_weight_bytes, "grads": master if stage >= 2 else weight_bytes,
            "optimizer": master * copies}  # fmt: skip


class DeepSpeedEngine:
    """``deepspeed.initialize`` around the built model; one ``train_step`` is one optimizer step."""

    # What --bf16/--fp16 mean here (printed at start: the engines differ)
    MIXED_PRECISION = {
        d: f"{d} weights with fp32 master copies in the optimizer; gradients reduced in {d} "
        "(unless --deepspeed-config sets communication_data_type)"
        for d in ("bf16", "fp16")
    }

    @staticmethod
    def build_hook(args: argparse.Namespace, dp_group: Group, tp_group: Group) -> Callable | None:
        """Under ZeRO-3, ``zero.Init``'s partitioning applied per build unit: each unit (a transformer
        layer, say) is materialised, initialised by HF's own initialiser exactly as without ZeRO, then
        partitioned over the data-parallel ranks before the next unit is allocated, so no rank ever
        holds more than its partition plus one unit."""
        deepspeed = _import_deepspeed()
        config = deepspeed_config(args, group_size(dp_group))
        _check_precision_supported(config)  # the trainer calls this hook before it builds the model
        if config["zero_optimization"]["stage"] != 3:
            return None
        # zero.Init checks batch sizes against its own world size: give it only what partitioning reads.
        partitioning = {k: v for k, v in config.items() if k in ("zero_optimization", "fp16", "bf16")}
        partitioning["train_micro_batch_size_per_gpu"] = args.micro_batch_size
        init = deepspeed.zero.Init(data_parallel_group=dp_group, config_dict_or_path=partitioning)

        def partition(modules: list[nn.Module]) -> None:
            """Partition these modules' own parameters over the data-parallel group now."""
            params = [p for m in modules for p in m.parameters(recurse=False)]
            convert_to_zero_parameters(init, params)  # zero.Init(module=...) without recursing into other units

        return partition

    def __init__(
        self, model: nn.Module, args: argparse.Namespace, dp_group: Group, tp_group: Group, shape: ModelShape
    ) -> None:
        """``deepspeed.initialize`` with our AdamW as its client optimizer and the config from the flags
        (or ``--deepspeed-config``); the LR schedule stays ours (megatron-core's, stepped in samples).
        Sequence-parallel gradients are summed over TP in autograd hooks registered before ZeRO's."""
        deepspeed = _import_deepspeed()
        reduce_sequence_parallel_grads_in_backward(model, tp_group)  # before ZeRO's own gradient hooks see them
        self.model, self.args, self.dp_group, self.tp_group = model, args, dp_group, tp_group
        self.config = deepspeed_config(args, group_size(dp_group))
        _check_precision_supported(self.config)
        self.stage = self.config["zero_optimization"]["stage"]
        self.ds, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=build_optimizer(model, args), config=self.config, mpu=_MPU(dp_group, tp_group)
        )
        self.scheduler = build_scheduler(self.optimizer, args)
        self.device = self.ds.device
        self._gathered = deepspeed.zero.GatheredParameters
        from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param

        self._get_fp32, self._set_fp32 = safe_get_full_fp32_param, safe_set_full_fp32_param

    # ----------------------------------------------------------------------------------------------
    def _master_numel(self) -> int:
        """Elements of the fp32 master weights this rank's optimizer updates."""
        groups = getattr(self.optimizer, "single_partition_of_fp32_groups", None)  # ZeRO-1/2
        groups = groups if groups is not None else getattr(self.optimizer, "fp32_partitioned_groups_flat", None)
        if groups is None:  # stage 0: the optimizer works on the parameters themselves
            return sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        return sum(g.numel() for g in groups)

    def memory_report(self) -> dict[str, int]:
        """Weights: this rank's ZeRO-3 partition (or all); gradients: a partition from stage 2; the
        optimizer: AdamW's two moments over its partition and fp32 master weights (:func:`zero_state`)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        local = tensor_bytes([local_part(p) for p in params])
        half = half_precision(self.args) is not None
        return zero_state(self.stage, local, tensor_bytes(params), self._master_numel(), half)

    def train_step(self, microbatches: list[Batch], task: Task) -> StepResult:
        """DeepSpeed's own loop over the micro-batches (``backward`` scales by the accumulation steps,
        ``step`` reduces, clips and steps at the boundary only); the step's result read back from it
        (whether it was applied, its gradient norm, the fp16 scale it ran with)."""
        steps = self.config["gradient_accumulation_steps"]
        if len(microbatches) != steps:
            raise ValueError(f"DeepSpeed was configured for {steps} micro-batches per step, got {len(microbatches)}")
        self.ds.train()
        totals: dict[str, torch.Tensor] = {}
        scale = float(getattr(self.optimizer, "cur_scale", 1.0))
        for batch in microbatches:
            loss, metrics = task.loss(self.ds, to_device(batch, self.device))
            self.ds.backward(loss)  # scales by 1 / accumulation steps; reduces at the last one
            self.ds.step()  # the optimizer steps (and clips) at the accumulation boundary only
            accumulate(totals, metrics)
        applied = self.ds.was_step_applied()
        norm = self.ds.get_global_grad_norm()
        norm = float(norm) if norm is not None else None  # None: no norm to tell a NaN step by
        if applied:
            self.scheduler.step(increment=self.args.global_batch_size)
        return StepResult(
            metrics=average_metrics(totals, len(microbatches), self.dp_group),
            grad_norm=norm if applied else None,
            loss_scale=scale,
            skipped=not applied,
            overflow=not applied and self.args.fp16,
            learning_rate=self.optimizer.param_groups[0]["lr"],
            params_norm=global_norm(
                list(self.model.parameters()),
                self.tp_group,
                of_grads=False,
                partition_group=self.dp_group if self.stage == 3 else None,
            )
            if self.args.log_params_norm
            else None,
        )

    def eval_step(self, microbatches: list[Batch], task: Task) -> dict[str, float]:
        """Forward only through the DeepSpeed engine (ZeRO-3 gathers each module as it runs)."""
        return evaluate(self.ds, microbatches, task, self.device, self.dp_group)

    # ----------------------------------------------------------------------------------------------
    def _named_params(self) -> dict[int, tuple[nn.Parameter, list[str]]]:
        """Each parameter once, with all its names (tied weights have several)."""
        out: dict[int, tuple[nn.Parameter, list[str]]] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            out.setdefault(id(p), (p, []))[1].append(name)
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The TP rank's whole model on the CPU, weights from the fp32 masters. Collective (stage 3)."""
        state = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}  # buffers: not partitioned
        for p, names in self._named_params().values():
            full = self._get_fp32(p)
            if full is None:  # stage 0 without mixed precision: the weights are the masters
                with self._gathered([p], enabled=self.stage == 3):
                    full = p.detach().float()
            full = full.detach().cpu().clone().view(p.ds_shape if hasattr(p, "ds_shape") else p.shape)
            for name in names:
                state[name] = full
        return state

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Set the weights (and their fp32 masters) from a full state dict, e.g. a --finetune start."""
        params = [p for p, _ in self._named_params().values()]
        with self._gathered(params, modifier_rank=0, enabled=self.stage == 3):
            self.model.load_state_dict(state)  # shapes and keys checked here (RuntimeError)
        for p, names in self._named_params().values():
            self._set_fp32(p, state[names[0]].to(self.device, torch.float32))

    def state_dict(self, directory: str, include_optimizer: bool = True) -> dict[str, Any]:
        """The TP rank's whole weights from the fp32 masters (so the file is the same as every engine's);
        with ``include_optimizer``, DeepSpeed's own ZeRO checkpoint written under ``directory`` (its
        stage and DP size kept here, to refuse another layout on load) and the LR schedule."""
        state: dict[str, Any] = {"model": self.full_state_dict()}
        if include_optimizer:
            self.ds.save_checkpoint(directory, tag=TAG, save_latest=False)
            state["optimizer"] = {
                "files": TAG,
                "zero_stage": self.stage,
                "data_parallel_size": group_size(self.dp_group),
            }
            state["opt_param_scheduler"] = self.scheduler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any], directory: str, load_optimizer: bool = True) -> None:
        """Without the optimizer: set the weights and their fp32 masters from the whole saved weights.
        With it: DeepSpeed's ZeRO checkpoint, which must come from the same stage and data-parallel
        size (``CheckpointError`` otherwise), and our LR schedule."""
        saved = state.get("optimizer")
        if not (load_optimizer and saved):
            self.load_full_state_dict(state["model"])
            return
        here = {"zero_stage": self.stage, "data_parallel_size": group_size(self.dp_group)}
        for key, value in here.items():
            if saved.get(key) != value:
                raise CheckpointError(
                    f"{directory} holds ZeRO state for {key.replace('_', ' ')} {saved.get(key)}, this run has "
                    f"{value}; pass --no-load-optim to load only the weights"
                )
        if not os.path.isdir(os.path.join(directory, saved["files"])):
            raise CheckpointError(f"{directory}/{saved['files']} (DeepSpeed's ZeRO state) is missing")
        self.ds.load_checkpoint(
            directory, tag=saved["files"], load_optimizer_states=True, load_lr_scheduler_states=False
        )
        self.scheduler.load_state_dict(state["opt_param_scheduler"])

    def sharded_state(self, include_optimizer: bool = True) -> EngineState:
        """The fp32 master weights and AdamW's moments as this rank holds them: whole at stage 0, a
        run of the flat partition per parameter at stages 1-2, a partition of each at stage 3
        (:mod:`~megatron_slapo.engines.deepspeed_state`); nothing is gathered."""
        return self._state().sharded_state(include_optimizer)

    def load_sharded_state(self, fill: Fill, load_optimizer: bool = True) -> None:
        """Load into the fp32 masters (and moments) in place, then the weights the forward reads
        from them; the step count, LR schedule and fp16 loss scale. Collective."""
        self._state().load(fill, load_optimizer)

    def _state(self) -> DeepSpeedState:
        """A view of DeepSpeed's optimizer as it is now (which ZeRO stage, which rank's partitions)."""
        return DeepSpeedState(self.model, self.optimizer, self.scheduler, self.stage, group_rank(self.dp_group),
                              self.args.fp16)  # fmt: skip
