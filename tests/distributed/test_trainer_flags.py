"""The trainer's Megatron flags in real runs on 2 ranks: exits, signals, samples, test split, RNG, logs."""

import datetime
import os
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from megatron_slapo.checkpoints import checkpointing, dist_checkpoint
from megatron_slapo.training.exit_conditions import ExitConditions
from megatron_slapo.training.loop import pretrain
from megatron_slapo.training.reporting import Reporter
from tests.distributed.runs import TINY, TP2, last_rank_value
from tests.utils import tb_scalars, tb_tags


def run_args(cache, *extra):
    return [*TINY, "--log-interval", "1", "--eval-iters", "0", "--data-cache-path", cache, *extra]


def test_saves_and_arguments_are_logged_and_no_save_rng_needs_no_load_rng(shared_tmp, cache, rank, capsys):
    """Saves and the arguments on rank 0's log; a checkpoint saved with --no-save-rng and
    --no-save-optim holds neither (resuming it needs --no-load-rng, and starts the optimizer afresh)."""
    ck = os.path.join(shared_tmp, "ck-no-rng")
    pretrain("gpt", run_args(cache, "--train-iters", "2", "--save", ck, "--save-interval", "1", "--no-save-rng",
                             "--no-save-optim"))  # fmt: skip
    out = capsys.readouterr().out
    if rank == 0:
        assert "------------------------ arguments ------------------------" in out
        assert f"\n  train_iters {'.' * 37} 2\n" in out and "-------------------- end of arguments" in out
        for it in (1, 2):
            saving = (f"saving checkpoint at iteration {it:7d} to {ck} in torch_dist format\n  successfully saved "
                      f"checkpoint at iteration {it:7d} to {ck}\n")  # fmt: skip
            assert saving in out, out[-3000:]
    else:
        assert "saving checkpoint" not in out and "-- arguments --" not in out  # rank 0 only, as Megatron
    root = checkpointing.iteration_dir(ck, 2)
    common = dist_checkpoint.read_common(root)
    assert "rng_state" not in common and common["iteration"] == 2 and not common["has_optimizer"]
    saved = dcp.FileSystemReader(root).read_metadata().state_dict_metadata
    assert any(k.startswith("model.") for k in saved) and not any(k.startswith("optimizer.") for k in saved)
    with pytest.raises(SystemExit):
        pretrain("gpt", run_args(cache, "--train-iters", "3", "--load", ck))
    err = capsys.readouterr().err
    assert rank != 0 or "holds no RNG state (saved with --no-save-rng); pass --no-load-rng" in err  # printed once
    assert pretrain("gpt", run_args(cache, "--train-iters", "3", "--load", ck, "--no-load-rng")).iteration == 3
    out = capsys.readouterr().out
    assert rank != 0 or "has no optimizer state (saved with --no-save-optim)" in out, out[-3000:]


def test_exit_duration_stops_saves_and_skips_the_final_evaluation(shared_tmp, cache, rank, capsys):
    ck = os.path.join(shared_tmp, "ck-duration")
    state = pretrain("gpt", run_args(cache, "--train-iters", "50", "--exit-duration-in-mins", "1e-6", "--save", ck,
                                     "--eval-iters", "1", "--eval-interval", "100"))  # fmt: skip
    out = capsys.readouterr().out
    assert state.iteration == 1 and checkpointing.latest_iteration(ck) == 1  # every rank stopped after step 1
    assert rank != 0 or re.search(r"exiting program after [\d.]+ minutes \(--exit-duration-in-mins 1e-06\)", out)
    assert "validation loss at the end of training" not in out


def test_exit_conditions_take_the_max_over_ranks(rank):
    # Only rank 1 has run past the limit (its clock started 2 minutes ago): both ranks stop.
    started = time.time() - (120 if rank == 1 else 0)
    with ExitConditions(1.0, False, started) as exits:
        reason = exits.check()
    assert reason is not None and reason.startswith("exiting program after 2.0")
    with ExitConditions(1.0, True, time.time()) as exits:
        assert exits.check() is None
        exits.received = rank == 0  # only rank 0 got the signal
        assert exits.check() == "exiting program after receiving SIGTERM."


def test_sigterm_finishes_the_step_saves_and_exits_on_every_rank(shared_tmp, cache, rank, capsys, monkeypatch):
    ck = os.path.join(shared_tmp, "ck-sigterm")
    before = signal.getsignal(signal.SIGTERM)
    step = Reporter.step

    def step_then_signal(self, iteration, *a, **k):  # as SLURM would, to one process, mid-run
        step(self, iteration, *a, **k)
        if iteration == 2 and rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(Reporter, "step", step_then_signal)
    state = pretrain("gpt", run_args(cache, "--train-iters", "6", "--exit-signal-handler", "--save", ck))
    out = capsys.readouterr().out
    assert state.iteration == 2 and checkpointing.latest_iteration(ck) == 2
    assert rank != 0 or "exiting program after receiving SIGTERM." in out
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is the run's only
    resumed = pretrain("gpt", run_args(cache, "--train-iters", "3", "--load", ck))
    assert resumed.iteration == 3 and resumed.consumed_train_samples == 3 * 8


def test_train_samples_and_the_test_split_at_the_end(shared_tmp, cache, rank, capsys):
    tb = os.path.join(shared_tmp, "tb-samples")
    state = pretrain("gpt", run_args(cache, "--train-samples", "20", "--eval-iters", "1", "--eval-interval", "2",
                                     "--split", "90,5,5", "--tensorboard-dir", tb))  # fmt: skip
    out = capsys.readouterr().out
    assert state.iteration == 2 and state.consumed_train_samples == 16  # 20 // 8 iterations, as Megatron
    blocks = last_rank_value(lambda: re.findall(r"validation loss at the end of training for (\w+) data \| "
                                                r"lm loss value: ([\d.E+-]+)", out))  # fmt: skip
    assert [name for name, _ in blocks] == ["val", "test"]
    assert blocks[0][1] != blocks[1][1]  # another split, another loss
    assert "iteration        2/       2" in last_rank_value(lambda: out)
    assert "lm loss test" in last_rank_value(lambda: tb_tags(tb))
    # The default --split 969,30,1 leaves this small corpus no test documents: said, and skipped.
    pretrain("gpt", run_args(cache, "--train-iters", "1", "--eval-iters", "1", "--eval-interval", "1"))
    out = capsys.readouterr().out
    assert rank != 0 or "no test evaluation: --split 969,30,1 leaves the test split no documents" in out
    assert "for test data" not in last_rank_value(lambda: out)


def test_documents_flags_train_alike_with_tensor_and_data_parallelism(shared_tmp, cache):
    flags = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]
    run = run_args(
        cache, "--train-iters", "3", "--seq-length", "64", "--hidden-dropout", "0", "--attention-dropout", "0"
    )
    tb = os.path.join(shared_tmp, "tb-documents")
    pretrain("gpt", [*run, *flags, *TP2, "--tensorboard-dir", f"{tb}/tp"])
    pretrain("gpt", [*run, *flags, "--tensorboard-dir", f"{tb}/dp"])
    pretrain("gpt", [*run, *TP2, "--tensorboard-dir", f"{tb}/plain"])
    tp, dp, plain = (last_rank_value(lambda d=d: tb_scalars(f"{tb}/{d}", "lm loss")) for d in ("tp", "dp", "plain"))
    assert max(abs(tp[i] - dp[i]) for i in tp) < 1e-5, (tp, dp)  # the vocabulary-parallel path sees the same inputs
    assert max(abs(tp[i] - plain[i]) for i in tp) > 1e-4, (tp, plain)  # and the flags do change the losses


def test_distributed_timeout_reaches_the_process_groups(cache):
    from megatron.core import parallel_state as ps

    pretrain("gpt", run_args(cache, "--train-iters", "1", "--distributed-timeout-minutes", "7"))
    for group in (ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()):
        assert group._get_backend(torch.device("cpu")).options._timeout == datetime.timedelta(minutes=7)
    dist.barrier()


@pytest.mark.parametrize("layout", [[], ["--pipeline-model-parallel-size", "2"]], ids=["dp2", "pp2"])
def test_metrics_are_read_only_at_the_log_and_tensorboard_intervals(shared_tmp, cache, rank, monkeypatch, layout):
    """Reading a metric waits for the device. Steps hand their metrics on as tensors; the trainer
    reads them at --log-interval (every rank: the line) and --tensorboard-log-interval (the last
    rank, which writes), as Megatron-LM does: 8 steps, intervals 4 and 8 -> 2 reads, 3 on the last rank."""
    from megatron_slapo.training import reporting

    reads = []
    original = reporting.metrics_to_floats

    def counting(metrics):
        reads.append(sorted(metrics))
        return original(metrics)

    kinds = set()
    step = reporting.Reporter.step

    def recording(self, iteration, consumed, result, seconds):
        kinds.update(type(v) for v in result.metrics.values())
        return step(self, iteration, consumed, result, seconds)

    monkeypatch.setattr(reporting, "metrics_to_floats", counting)
    monkeypatch.setattr(reporting.Reporter, "step", recording)
    tb = os.path.join(shared_tmp, f"tb-reads-{len(layout)}")
    pretrain("gpt", run_args(cache, *layout, "--train-iters", "8", "--log-interval", "4", "--tensorboard-log-interval",
                             "8", "--tensorboard-dir", tb))  # fmt: skip
    assert kinds == {torch.Tensor}  # not read by the engine either
    assert reads == [["lm loss"]] * (3 if rank == dist.get_world_size() - 1 else 2), reads
    assert sorted(last_rank_value(lambda: tb_scalars(tb, "lm loss"))) == [8]
