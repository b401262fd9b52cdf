"""Helpers for the tests that run ``pretrain_gpt.py`` / ``pretrain_bert.py`` end to end in-process.

Losses are read back from the TensorBoard event files the runs write (the last rank writes them)
and shared with every rank, so that all ranks assert the same thing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable

import pytest
import torch.distributed as dist

from megatron_slapo.training.loop import pretrain
from tests.utils import tb_scalars

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "4", "--global-batch-size", "8", "--num-workers", "0"]  # fmt: skip
TP2 = ["--schedule", "gpt_tp", "--tensor-model-parallel-size", "2"]
# Parity runs: no dropout (its masks depend on the layout), a log line and TensorBoard point every step.
PARITY = [*TINY, "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "10", "--log-interval", "1",
          "--eval-iters", "0"]  # fmt: skip
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def last_rank_value(fn):
    """Run ``fn`` on the last rank (where TensorBoard files and the log line are) and share its result."""
    box = [fn() if dist.get_rank() == dist.get_world_size() - 1 else None]
    dist.broadcast_object_list(box, src=dist.get_world_size() - 1)
    return box[0]


def train_losses(task: str, argv: list[str], tb: str, tag: str = "lm loss") -> dict[int, float]:
    """Train in-process on every rank; return the loss (TensorBoard ``tag``) per iteration."""
    pretrain(task, [*argv, "--tensorboard-dir", tb])
    return last_rank_value(lambda: tb_scalars(tb, tag))


def first_rank_value(fn):
    """Run ``fn`` on rank 0 (where the single-process reference wrote) and share its result."""
    box = [fn() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# Runs a script with torch's own convolution kernels instead of oneDNN's: the same maths, rounded otherwise
_OTHER_KERNELS = ("import runpy, sys, torch; torch.backends.mkldnn.enabled = False; sys.argv = sys.argv[1:]; "
                  "runpy.run_path(sys.argv[0], run_name='__main__')")  # fmt: skip


def plain_env() -> dict[str, str]:
    """This environment less torchrun's variables: for a plain process started from a rank."""
    return {k: v for k, v in os.environ.items() if k not in _TORCHRUN_ENV and not k.startswith("TORCHELASTIC")}


def single_process_losses(
    task: str, argv: list[str], tb: str, tag: str = "lm loss", other_kernels: bool = False
) -> dict[int, float]:
    """The same run as one plain process (no torchrun), started by rank 0: the reference layout.
    ``other_kernels``: with torch's own convolution kernels, to measure what rounding alone moves."""

    def run() -> str | None:
        script = os.path.join(ROOT, f"pretrain_{task}.py")
        runner = [sys.executable, "-c", _OTHER_KERNELS] if other_kernels else [sys.executable]
        cmd = [*runner, script, *argv, "--tensorboard-dir", tb]
        done = subprocess.run(cmd, env=plain_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
        return None if done.returncode == 0 else done.stderr[-3000:]

    _assert_ran(first_rank_value(run))
    return first_rank_value(lambda: tb_scalars(tb, tag))


def _assert_ran(error: str | None) -> None:
    """On every rank (none left waiting for one that failed): the reference process's error, if any."""
    assert error is None, error


def single_process_batch(runs: list[tuple[str, list[str], str]], shared_tmp: str) -> None:
    """Each ``(task, argv, tb)`` of ``runs`` as :func:`single_process_losses` would run it, all in one
    plain process started by rank 0 (``reference_batch.py``: the imports paid once)."""

    def run() -> str | None:
        listing = os.path.join(shared_tmp, f"reference-batch-{os.getpid()}-{len(runs)}.json")
        with open(listing, "w") as f:
            json.dump([[task, [*argv, "--tensorboard-dir", tb]] for task, argv, tb in runs], f)
        cmd = [sys.executable, os.path.join(ROOT, "tests", "distributed", "reference_batch.py"), listing]
        done = subprocess.run(cmd, env=plain_env(), cwd=ROOT, capture_output=True, text=True, timeout=60 * len(runs))
        return None if done.returncode == 0 else done.stderr[-3000:]

    _assert_ran(first_rank_value(run))


def reference_losses(
    shared_tmp: str, run_of: Callable[[str], tuple[str, list[str]]], keys: Iterable[str] = ()
) -> Callable[[str], dict]:
    """``get(key)``: :func:`single_process_losses` of the run ``run_of(key)`` (task, argv), computed
    once per torchrun session, on first use; the first use of one of ``keys`` (those this session's
    tests will ask for) runs all of them at once, in one process (:func:`single_process_batch`).
    ``get(key, tag)``: another TensorBoard scalar of that run (``"grad-norm"``), per iteration."""
    found: dict[str, dict[int, float]] = {}
    batched = list(dict.fromkeys(keys))

    def tb(key: str) -> str:
        return os.path.join(shared_tmp, f"tb-reference-{key}")

    def get(key: str, tag: str = "lm loss") -> dict[int, float]:
        if key in batched and key not in found:
            pending = [k for k in batched if k not in found]
            single_process_batch([(*run_of(k), tb(k)) for k in pending], shared_tmp)
            for k in pending:
                found[k] = first_rank_value(lambda k=k: tb_scalars(tb(k), "lm loss"))
        if key not in found:
            task, argv = run_of(key)
            found[key] = single_process_losses(task, argv, tb(key))
        return found[key] if tag == "lm loss" else first_rank_value(lambda: tb_scalars(tb(key), tag))

    return get


def asked(request: pytest.FixtureRequest, argname: str) -> list:
    """The ``argname`` values of this session's tests (those ``-m``/``-k`` selected, not skipped for
    another world size) that use the fixture ``request`` sets up, in its module: the references
    worth computing together (the default tier's few, not the slow tier's many)."""
    items = [item for item in request.session.items if item.module is request.module
             and request.fixturename in item.fixturenames and not item.get_closest_marker("skip")]  # fmt: skip
    params = [getattr(item, "callspec", None) for item in items]  # an unparametrized test has none
    return [p.params[argname] for p in params if p is not None and argname in p.params]


def layout_case(key: str, layout: str, world_sizes: tuple[int, ...], flags: list[str], slow: bool = False) -> pytest.param:
    """One parity case: ``key`` (task or family) trained with ``flags``, at ``world_sizes`` only
    (``slow``: in the slow tier)."""
    marks = [pytest.mark.world_sizes(*world_sizes), *([pytest.mark.slow] if slow else [])]
    return pytest.param(key, flags, id=f"{key}-{layout}", marks=marks)


def assert_parity(losses: dict[int, float], expected: dict[int, float], tolerance: float, steps: int = 10) -> None:
    """The same ``steps`` iterations, each loss within ``tolerance``, and a reference that did learn
    (parity between two flat lines would prove nothing)."""
    assert sorted(losses) == sorted(expected) == list(range(1, steps + 1))
    worst = max(abs(losses[i] - expected[i]) for i in expected)
    assert worst < tolerance, (worst, losses, expected)
    assert expected[steps] < expected[1] - 0.1


def assert_grad_norm_parity(tb: str, expected: dict[int, float], tolerance: float) -> None:
    """Every step's gradient norm (TensorBoard's ``grad-norm`` of the run written to ``tb``) within
    ``tolerance``, relative, of the reference's: gradients reduced over the wrong ranks or with a
    wrong factor show here, even where Adam's scale-invariant update hides a factor from the losses."""
    norms = last_rank_value(lambda: tb_scalars(tb, "grad-norm"))
    assert sorted(norms) == sorted(expected), (norms, expected)
    worst = max(abs(norms[i] - expected[i]) / expected[i] for i in expected)
    assert worst < tolerance, (worst, norms, expected)


def random_batches(run, seed: int) -> list[dict]:
    """One step's micro-batches of random tokens (ids below 100) for the built ``run``
    (``run.setup``): as many as the global batch gives each data-parallel rank, drawn from
    ``seed``, which a test makes differ between steps and data-parallel ranks."""
    import torch

    args = run.args
    count = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    generator = torch.Generator().manual_seed(seed)
    shape = (args.micro_batch_size, args.seq_length)
    return [{"tokens": torch.randint(0, 100, shape, generator=generator),
             "labels": torch.randint(0, 100, shape, generator=generator),
             "loss_mask": torch.ones(shape)} for _ in range(count)]  # fmt: skip


def refused_on_every_rank(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    """Run ``pretrain`` on every rank; return the error line, checked to be the same on every rank
    that prints it (rank 0 does), each exiting with status 2 and no traceback."""
    with pytest.raises(SystemExit) as exit_:
        pretrain("gpt", argv)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    first = [lines[0] if dist.get_rank() == 0 and lines else None]
    dist.broadcast_object_list(first, src=0)
    assert exit_.value.code == 2
    assert first[0] is not None and first[0].startswith("pretrain_gpt.py: error: ")
    assert lines == first if dist.get_rank() == 0 else lines in ([], first), lines  # rank 1: silent, or the same
    return first[0]
