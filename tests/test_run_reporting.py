"""What a run reports about itself: its TensorBoard directory named by what ran (and kept by the
run that resumes it), and the memory of its first step measured as explain estimates it
(training/reporting.py, training/memory.py)."""

import re
import time

import torch
from torch import nn

from megatron_slapo.arguments.parser import parse_args
from megatron_slapo.arguments.validation import validate_args
from megatron_slapo.engines.base import ModelShape
from megatron_slapo.parallel.state import Layout
from megatron_slapo.training.memory import StepMeter
from megatron_slapo.training.reporting import tensorboard_dir
from megatron_slapo.training.settings import resolve_settings


def _directory(task: str, flags: list[str], world: int, shape: ModelShape) -> str | None:
    args = parse_args(task, flags)
    validate_args(args, world)
    settings, _ = resolve_settings(args)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    return tensorboard_dir(args, settings, shape, Layout(0, tp, 0, pp, 0, None))


def test_a_run_without_tensorboard_dir_is_named_by_what_ran():
    gpt = _directory("gpt", ["--tensor-model-parallel-size", "2"], 4, ModelShape(4, 256, 4))
    assert re.fullmatch(r"runs/gpt-gpt2-4x256-tp2pp1dp2-gpt_tp/\d{8}-\d{6}", gpt), gpt
    flags = ["--model-type", "albert", "--pipeline-model-parallel-size", "1", "--schedule", "default"]
    bert = _directory("bert", flags, 1, ModelShape(4, 256, 4))
    assert re.fullmatch(r"runs/bert-albert-4x256-tp1pp1dp1-default/\d{8}-\d{6}", bert), bert
    vision = _directory("vision", [], 2, ModelShape(8, 640, 1))
    assert re.fullmatch(r"runs/vision-wideresnet-8x640-tp1pp1dp2-[a-z_]+/\d{8}-\d{6}", vision), vision
    given = ["--tensor-model-parallel-size", "2", "--tensorboard-dir", "tb/mine"]
    assert _directory("gpt", given, 2, ModelShape(4, 256, 4)) == "tb/mine"
    data = ["--mock-data", "--micro-batch-size", "2", "--lr", "1e-3", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "128", "--train-iters", "2", "--num-layers", "2", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "32"]  # fmt: skip
    assert _directory("gpt", data, 1, ModelShape(2, 64, 4)) is None  # a run on its own data: as Megatron, none


def test_a_resumed_run_writes_on_in_the_tensorboard_folder_of_the_run_it_resumes(tmp_path, monkeypatch):
    """The embedded run's default folder (``runs/<name>/<time>``, under the working directory) is
    recorded in its checkpoint; the run that resumes it, a second later, writes its steps there."""
    from megatron_slapo import parallel
    from megatron_slapo.training.loop import pretrain
    from tests.utils import tb_scalars

    monkeypatch.chdir(tmp_path)
    argv = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
            "--micro-batch-size", "2", "--log-interval", "1", "--eval-iters", "0", "--data-cache-path",
            str(tmp_path / "cache"), "--save", "ck"]  # fmt: skip
    pretrain("gpt", [*argv, "--train-iters", "2"])
    parallel.destroy()
    (folder,) = (tmp_path / "runs").glob("*/*")
    time.sleep(1.1)  # a new folder would have another name
    pretrain("gpt", [*argv, "--train-iters", "4", "--load", "ck"])
    parallel.destroy()
    assert list((tmp_path / "runs").glob("*/*")) == [folder] and len(list(folder.glob("events.out.*"))) == 2
    assert sorted(tb_scalars(str(folder), "lm loss")) == [1, 2, 3, 4]  # one curve, its steps going on
    pretrain("gpt", [*argv, "--train-iters", "5", "--load", "ck", "--tensorboard-dir", "mine"])  # as Megatron:
    assert sorted(tb_scalars("mine", "lm loss")) == [5]  # a folder given is the one written
    assert sorted(tb_scalars(str(folder), "lm loss")) == [1, 2, 3, 4]


def _micro_batches() -> list[torch.Tensor]:
    return [torch.randn(16, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)]


def _step(model: nn.Module, batches: list[torch.Tensor]) -> list[torch.Tensor]:
    model.zero_grad()
    for x in batches:
        model(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_the_first_steps_memory_is_measured_without_changing_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    batches = _micro_batches()
    unmeasured = _step(model, batches)
    state = {"params": 1000, "grads": 100, "optimizer": 10}
    with StepMeter(model, lambda: state, len(batches)) as meter:
        measured = _step(model, batches)
    assert all(torch.equal(a, b) for a, b in zip(unmeasured, measured, strict=True))
    # per micro-batch, fp32: the first Linear's input (16x8), the ReLU's output, which the second Linear
    # saves too (16x16, once), the square's input (16x4); no weight (a view of one included)
    assert meter.result.activations == (16 * 8 + 16 * 16 + 16 * 4) * 4
    # at most alive at once: the second micro-batch's, and the first's input, which the batch list keeps
    assert meter.result.peak == (2 * 16 * 8 + 16 * 16 + 16 * 4) * 4 + sum(state.values())
    assert "parameters + gradients + optimizer" in meter.result.peak_source
    total = meter.total
    _step(model, batches)
    assert meter.total == total  # the hooks went with the step


def test_the_start_up_lines_name_context_and_expert_parallel_ranks_as_such():
    """A context-parallel rank is not labelled a data-parallel one (Layout's dp_rank counts both),
    and the note of a run without tensor parallelism names the experts' split and the context ranks."""
    from megatron_slapo.training.plan import describe_ranks

    split = Layout(0, 1, 0, 1, 1, None, cp_rank=1, cp_size=2, data_rank=0)
    assert split.coordinates() == ("(tensor, pipeline, data, context)", (0, 0, 0, 1))
    assert Layout(0, 2, 1, 2, 3, None).coordinates() == ("(tensor, pipeline, data)", (0, 1, 3))
    ep = parse_args("gpt", ["--model-type", "qwen3_moe", "--num-experts", "4", "--expert-model-parallel-size", "2"])
    validate_args(ep, 2)
    assert describe_ranks(ep) == ("2 data-parallel ranks, the routed experts split over 2 expert-parallel ranks out "
                                  "of the data-parallel ones")  # fmt: skip
    cp = parse_args("gpt", ["--model-type", "llama", "--context-parallel-size", "2"])
    validate_args(cp, 4)
    assert describe_ranks(cp) == "2 data-parallel x 2 context-parallel ranks"
