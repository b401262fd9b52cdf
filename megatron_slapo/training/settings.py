"""The run's settings: what it trains and how it is scheduled, decided once, before anything runs.

Several flags decide these together, and an HF config may override a flag's default:
``--model-type`` gives way to the type of the ``--hf-config`` / ``--load-hf`` model, ``--schedule``
defaults to the schedule for that type and ``--tensor-model-parallel-size``, ``--seq-length`` to the model's positions.
:func:`resolve_settings` decides them right after argument validation (``training/plan.py``'s
``prepare``); everything after reads the frozen :class:`RunSettings`, and the arguments stay as
validation left them. Once the model's config is built, :func:`check_schedule` checks that the
schedule fits it, and refuses a family no schedule is verified on where the layout needs one.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import transformers

from megatron_slapo.errors import ConfigError
from megatron_slapo.training.model import create_model, read_hf_config
from schedules import check_fits, default_for, get_schedule, verified, written_for_others
from schedules.refusal import unverified_message, what_stops_auto


@dataclass(frozen=True)
class RunSettings:
    """What the run is, as the flags and the HF config decided it."""

    task: str  # gpt, bert, t5 or vision: which pretrain_<task>.py runs
    model_type: str  # the HF model type: --model-type's, or that of the --hf-config / --load-hf model
    hf_source: str | None  # "--load-hf DIR" / "--hf-config NAME" when an HF config gives the model, else None
    schedule: str  # the schedules/ module to apply
    schedule_given: bool  # named by --schedule; else the default for model_type and TP (schedules.default_for)
    seq_length: int | None  # --seq-length, else the HF config's positions; None for an image model
    tensor_parallel: int  # --tensor-model-parallel-size, which the default schedule follows

    @property
    def schedule_reason(self) -> str:
        """Why this schedule: ``--schedule`` named it, or it is the default for the model type at
        this tensor-parallel size."""
        if self.schedule_given:
            return "--schedule"
        if self.schedule == "auto" and self.tensor_parallel == 1:
            return f"the default for {self.model_type} with --expert-model-parallel-size > 1"
        return f"the default for {self.model_type} at --tensor-model-parallel-size {self.tensor_parallel}"

    def arguments(self, args: argparse.Namespace) -> dict[str, Any]:
        """``vars(args)`` with these settings in place of the flags they decide (schedule, model
        type, sequence length): the arguments as the run uses them, for the dump at start."""
        decided = {"schedule": self.schedule, "model_type": self.model_type, "seq_length": self.seq_length}
        given = vars(args)
        return {**given, **{name: value for name, value in decided.items() if name in given}}


def resolve_settings(args: argparse.Namespace) -> tuple[RunSettings, transformers.PretrainedConfig | None]:
    """Decide the run's settings from the validated ``args`` and the config of the model that
    ``--hf-config`` / ``--load-hf`` names (:func:`~megatron_slapo.training.model.read_hf_config`);
    return them with that config (None without either flag), which the model is built from. An
    unknown ``--schedule`` is refused first, before the process groups start."""
    if args.schedule is not None:
        get_schedule(args.schedule)
    hf_config = read_hf_config(args)
    source = None
    if args.load_hf or args.hf_config:
        source = f"--load-hf {args.load_hf}" if args.load_hf else f"--hf-config {args.hf_config}"
    model_type = hf_config.model_type if hf_config is not None else args.model_type
    tp = args.tensor_model_parallel_size
    ep = getattr(args, "expert_model_parallel_size", 1)
    schedule = default_for(model_type, tp, ep) if args.schedule is None else args.schedule
    seq_length = getattr(args, "seq_length", None)  # image models have none
    if seq_length is None and hf_config is not None and args.task != "vision":
        seq_length = hf_config.max_position_embeddings  # T5 has no positions: validation requires --seq-length
    settings = RunSettings(args.task, model_type, source, schedule, args.schedule is not None, seq_length, tp)
    return settings, hf_config


def check_schedule(args: argparse.Namespace, settings: RunSettings, config: transformers.PretrainedConfig) -> None:
    """The run's schedule fits its model (:func:`schedules.check_fits`), and a family that no schedule
    is verified on is refused where the layout needs its model split (tensor or expert parallelism,
    or ``--schedule auto`` named), with what stops ``auto`` on it, from auto's own checks on a
    model built on the meta device for the purpose (:mod:`schedules.refusal`). Before the data, the
    checkpoint or the run's model are read or built: the process groups must exist."""
    sizes = (("tensor", args.tensor_model_parallel_size), ("expert", getattr(args, "expert_model_parallel_size", 1)))
    needs = next((f"--{kind}-model-parallel-size {size}" for kind, size in sizes if size > 1), None)
    if needs is None and settings.schedule_given and settings.schedule == "auto":
        needs = "--schedule auto"
    if needs is not None and not verified(config.model_type):
        on_meta = argparse.Namespace(**{**vars(args), "load_hf": None})  # without --load-hf's weights
        why = what_stops_auto(create_model(on_meta, settings.task, config), args)
        other = written_for_others(settings.schedule, config.model_type) if settings.schedule != "auto" else None
        message = unverified_message(config.model_type, needs, why, args)
        raise ConfigError(f"{other}, and {message}" if other else message)
    check_fits(settings.schedule, config.model_type)
