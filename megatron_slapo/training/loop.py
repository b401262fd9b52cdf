"""The training loop behind ``pretrain_gpt.py``, ``pretrain_bert.py``, ``pretrain_t5.py`` and
``pretrain_vision.py``.

:func:`pretrain` does, in order: parse the arguments, set the run up (:mod:`.plan` validates,
starts the process groups, checks the data and the checkpoint to resume from and schedules the
meta model; :mod:`.run` materialises this rank's shards, hands them to the engine and loads the
checkpoint), and train: micro-batches from a resumable sampler, one engine step per iteration,
the Megatron log line, evaluation, checkpoints. Every input problem it can detect is reported as
one line before training starts.
"""

from __future__ import annotations

import argparse
import signal
import sys
import traceback
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from megatron_slapo import parallel
from megatron_slapo.arguments.parser import parse_args
from megatron_slapo.checkpoints import checkpointing, dist_checkpoint
from megatron_slapo.checkpoints.checkpointing import Resume
from megatron_slapo.data.samplers import data_loader
from megatron_slapo.parallel.comm_log import CommLog
from megatron_slapo.plans.expert_capacity import DROPPED
from megatron_slapo.training import error_report
from megatron_slapo.training.exit_conditions import ExitConditions
from megatron_slapo.training.reporting import print_rank_0
from megatron_slapo.training.run import Run, setup
from schedules import describe


class TrainingStopped(RuntimeError):
    """Training cannot go on (e.g. the loss diverged); the message says why."""


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
        with ExitConditions(args.exit_duration_in_mins, args.exit_signal_handler, run.started,
                            signal.Signals[args.exit_signal]) as exits:  # fmt: skip
            state = _loop(run, timers, comm, exits, train_batches, valid_batches, n_micro)
    finally:
        if comm:
            comm.uninstall()
    if exits.interrupted or (exits.received and exits.signum == signal.SIGINT):
        raise KeyboardInterrupt  # --exit-signal SIGINT (after the last check too): saved; now end as a Ctrl-C does
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
    started_at = state.iteration
    loaded_at = state.iteration if args.load and state.iteration else None  # resumed from a checkpoint there
    # Iterations in a row whose loss or gradients were not finite. Every engine skips such a step, so
    # the weights stay those before it, and are saved, unless every step of this run was one: then
    # the state it started from is the likely cause (a corrupt checkpoint) and is never saved.
    nan_streak = 0
    saves = dist_checkpoint.AsyncSaves() if args.async_save else None  # committed between steps once written

    def stop() -> TrainingStopped:  # a save in flight is of a sound state: committed before the run ends
        if saves:
            saves.wait()
        return TrainingStopped(_diverged(state.iteration, nan_streak, loaded_at, args.load))

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
            raise stop()
        if valid_batches and args.eval_interval and state.iteration % args.eval_interval == 0:
            metrics = evaluate(run, valid_batches, args.eval_iters, n_micro)
            state.consumed_valid_samples += args.eval_iters * args.global_batch_size
            run.reporter.validation(state.iteration, state.consumed_train_samples, metrics)
        if args.save and args.save_interval and state.iteration % args.save_interval == 0:
            if nan_streak == state.iteration - started_at:
                print_rank_0(f" > not saving iteration {state.iteration}: no step since iteration {started_at} had a "
                             "finite loss and gradients")  # fmt: skip
            else:
                checkpointing.save(run.engine, args, layout, state, run.metadata, run.recorded, saves)
                saved_at = state.iteration
        reason = exits.check()  # a collective when --exit-duration-in-mins / --exit-signal-handler is given
        if not reason and args.exit_interval and state.iteration % args.exit_interval == 0:
            reason = f"exiting program at iteration {state.iteration} (--exit-interval)"
        if reason:
            print_rank_0(reason)
            break
    if nan_streak and nan_streak == state.iteration - started_at:  # it would end on that state: stop instead
        raise stop()
    if args.save and saved_at != state.iteration:
        checkpointing.save(run.engine, args, layout, state, run.metadata, run.recorded, saves)
    if saves:
        saves.wait()  # the last one is on disk and committed before the run ends
    return state


def _diverged(iteration: int, streak: int, loaded_at: int | None, load: str | None) -> str:
    """Why a run whose last ``streak`` iterations were not finite stops; when every iteration since
    it resumed was, the checkpoint it loaded is the likely cause (a corrupt file, say, that its
    checksums could not catch)."""
    what = f"{streak} consecutive iterations" if streak > 1 else f"iteration {iteration}"
    line = f"stopping at iteration {iteration}: {what} had a NaN/inf loss or gradient"
    if loaded_at is not None and iteration - loaded_at == streak:
        return (f"{line}, every one since it resumed from iteration {loaded_at} of --load {load}: that checkpoint "
                "may be corrupt (load an earlier iteration); that state is not saved")  # fmt: skip
    return f"{line} (try a lower --lr or --clip-grad, or --bf16 instead of --fp16); that state is not saved"


def main(task: str) -> None:
    """``pretrain_<task>.py``'s entry point: :func:`pretrain`, then, when it finished, the process
    groups shut down before the interpreter does (left to its exit, gloo's threads can be torn down
    mid-flight and abort a finished run). An error's line, or a bug's traceback, goes to torchrun's
    failure summary as well (:func:`~.error_report.root_cause`); after it, or after a Ctrl-C's
    line, the process ends at once (:func:`~.error_report.exit_now`): a rank must not wait for
    peers that may be gone, and exiting lets torchrun stop the job."""
    try:
        with error_report.root_cause():
            pretrain(task)
    except SystemExit as e:
        error_report.exit_now(e.code)
    except Exception:
        traceback.print_exc()
        error_report.exit_now(1)
    parallel.destroy()


def pretrain(task: str, argv: list[str] | None = None) -> Resume | None:
    """Entry point of ``pretrain_{task}.py``; returns where training stopped (for tests). Bad input,
    a peer rank's death and a Ctrl-C end it with one line (:mod:`~megatron_slapo.training.error_report`)."""
    prog = f"pretrain_{task}.py"
    with error_report.user_errors(prog):
        args = parse_args(task, argv)
    if args.schedule == "list":
        print(describe())
        return None
    run: Run | None = None
    with error_report.interruptions(prog, lambda: _stopped_at(args, run)):  # reads `run` as it is by then
        with error_report.user_errors(prog), error_report.lost_peers(prog):
            run = setup(args)
        return _train(prog, run)


def _train(prog: str, run: Run) -> Resume:
    """:func:`train`, a diverging run's stop reported as one line (status 1)."""
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


def _stopped_at(args: argparse.Namespace, run: Run | None) -> str:
    """Where an interrupted run stopped, and the checkpoint it resumes from: the one ``--save``'s
    tracker names (the last committed, an asynchronous save in flight not), else the one loaded."""
    where = f"interrupted at iteration {run.resume.iteration}" if run else "interrupted before training started"
    for directory in filter(None, (args.save, args.load)):
        latest = checkpointing.latest_iteration(directory)
        if latest is not None:
            return f"{where}; last checkpoint: iteration {latest} in {directory}"
    return f"{where}; " + (f"no checkpoint saved yet in --save {args.save}" if args.save else "no checkpoint saved")
