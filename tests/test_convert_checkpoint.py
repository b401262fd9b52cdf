"""tools/convert_checkpoint.py on both checkpoint formats, in one process: exports hold the
checkpoint's weights exactly, round trips through either format are exact, bad input is one line.

The checkpoints are tiny GPT-2s (tied embedding, fused q|k|v). A ``torch_dist`` checkpoint is
written as a TP1 training run writes it (``checkpointing.save``, the vocabulary padded to 128
rows); tests/distributed/test_trainer.py exports one saved by a TP2 run.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers

from megatron_slapo import parallel
from megatron_slapo.checkpoints import checkpointing, conversion, dist_checkpoint
from megatron_slapo.checkpoints.checkpoint_files import LATEST, Resume, iteration_dir
from megatron_slapo.models.vocabulary import Vocabulary, tied_weights, vocab_parameter_names
from megatron_slapo.parallel.state import Layout
from megatron_slapo.training.loop import pretrain
from tools import convert_checkpoint

ROOT = Path(__file__).resolve().parents[1]

CONFIG = transformers.GPT2Config(vocab_size=100, n_positions=16, n_embd=16, n_layer=2, n_head=2)


def convert(argv: list[str]) -> None:
    """Run the tool here, then end the process group it started (if it started one)."""
    try:
        convert_checkpoint.main(argv)
    finally:
        parallel.destroy()


def refused(argv: list[str]) -> str:
    """The tool's one error line (its message), checked to be one line and to exit non-zero."""
    with pytest.raises(SystemExit) as exit_:
        convert(argv)
    line = str(exit_.value.code)
    assert "\n" not in line and line.startswith("convert_checkpoint.py: error: "), line
    return line.removeprefix("convert_checkpoint.py: error: ")


def assert_same_model(a: Path, b: Path) -> None:
    """The HF directories ``a`` and ``b`` hold the same GPT-2, bit for bit, its head tied."""
    x = transformers.GPT2LMHeadModel.from_pretrained(a)
    y = transformers.GPT2LMHeadModel.from_pretrained(b)
    assert y.lm_head.weight is y.transformer.wte.weight
    sa, sb = x.state_dict(), y.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


@pytest.fixture(scope="module")
def hf_gpt(tmp_path_factory) -> Path:
    """A tiny random GPT-2, as save_pretrained writes it."""
    path = tmp_path_factory.mktemp("hf") / "gpt"
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(CONFIG).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def dist_ck(hf_gpt, tmp_path_factory) -> Path:
    """``hf_gpt`` as a TP1 run at iteration 5 saves it in the torch_dist format (vocabulary padded
    to 128 rows, weights only)."""
    save = tmp_path_factory.mktemp("dist") / "ck"
    parallel.initialize(tensor_parallel=1)
    try:
        model = transformers.GPT2LMHeadModel.from_pretrained(hf_gpt)
        model.resize_token_embeddings(128, mean_resizing=False)
        metadata = checkpointing.export_metadata(
            model.state_dict(keep_vars=True), "GPT2LMHeadModel", "gpt", model.config, Vocabulary(100, 128),
            vocab_parameter_names(model), 1, tied_weights(model),
        )  # fmt: skip
        args = argparse.Namespace(save=str(save), ckpt_format="torch_dist", no_save_optim=True, no_save_rng=True,
                                  ckpt_fully_parallel_save=True, tensor_model_parallel_size=1)  # fmt: skip
        recorded = {"task": "gpt", "num_layers": 2, "make_vocab_size_divisible_by": 128, "lr": 1e-3}
        checkpointing.save(conversion.WeightsOnly(model), args, Layout.current(), Resume(5, 40, 8), metadata, recorded)
    finally:
        parallel.destroy()
    return save


def test_to_hf_reads_a_torch_dist_checkpoint_in_one_process(dist_ck, hf_gpt, tmp_path, capsys):
    convert(["to-hf", "--load", str(dist_ck), "--save-hf", str(tmp_path / "hf")])
    assert "wrote GPT2LMHeadModel (iteration 5, torch_dist)" in capsys.readouterr().out
    assert_same_model(hf_gpt, tmp_path / "hf")  # the padding rows dropped, the head tied again
    assert not dist.is_initialized()  # no process group: no torchrun needed


def test_from_hf_writes_a_torch_dist_checkpoint_of_the_hf_tensors(hf_gpt, tmp_path, capsys):
    ck = tmp_path / "ck"
    convert(["from-hf", "--load-hf", str(hf_gpt), "--save", str(ck)])
    root = iteration_dir(str(ck), 0)
    assert f"wrote {root} (torch_dist: loads at any layout); train from it: " in capsys.readouterr().out
    assert dist_checkpoint.is_dist_checkpoint(root) and (ck / LATEST).read_text() == "0"
    common = dist_checkpoint.read_common(root)
    assert common["slapo"]["vocab"]["true"] == common["slapo"]["vocab"]["padded"] == 100  # not padded
    saved = dcp.FileSystemReader(root).read_metadata().state_dict_metadata
    assert tuple(saved["model.transformer.wte.weight"].size) == (100, 16)
    assert "model.lm_head.weight" not in saved and not any(k.startswith("optimizer.") for k in saved)
    convert(["to-hf", "--load", str(ck), "--save-hf", str(tmp_path / "back")])
    assert_same_model(hf_gpt, tmp_path / "back")


def _printed_command(out: str) -> tuple[str, list[str]]:
    """The trainer command a conversion printed: its task and its arguments."""
    line = next(line for line in out.splitlines() if "pretrain_" in line)
    words = shlex.split(line.split("train from it: ")[-1].split("resume with ")[-1])
    script = next(i for i, word in enumerate(words) if word.startswith("pretrain_"))
    return words[script].removeprefix("pretrain_").removesuffix(".py"), words[script + 1 :]


def test_the_command_from_hf_prints_trains_on_your_data(hf_gpt, tmp_path, capsys):
    """What from-hf prints runs: the checkpoint gives the model's flags (no size flag is given), and
    a run on data of one's own adds the data flags the note asks for (and its length and batch)."""
    ck = tmp_path / "ck"
    convert(["from-hf", "--load-hf", str(hf_gpt), "--save", str(ck)])
    out = capsys.readouterr().out
    task, argv = _printed_command(out)
    assert (task, argv) == ("gpt", ["--load", str(ck), "--use-checkpoint-args", "--finetune", "--lr", "1e-5"]), out
    data = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--micro-batch-size", "2",
            "--train-iters", "2", "--eval-iters", "0", "--log-interval", "1"]  # fmt: skip
    state = pretrain(task, [*argv, *data, "--save", str(tmp_path / "tuned")])
    parallel.destroy()
    out = capsys.readouterr().out
    assert state.iteration == 2 and f"loaded checkpoint {iteration_dir(str(ck), 0)} at iteration 0" in out
    assert f"the model's flags from the checkpoint in --load {ck}: --hf-config {ck}" in out
    convert(["to-hf", "--load", str(tmp_path / "tuned"), "--save-hf", str(tmp_path / "back")])
    tuned = transformers.AutoConfig.from_pretrained(tmp_path / "back")
    assert (tuned.n_layer, tuned.n_embd, tuned.n_head, tuned.n_positions) == (2, 16, 2, 16)  # hf_gpt's shape


@pytest.mark.slow
def test_the_command_from_hf_prints_runs_as_printed(hf_gpt, tmp_path, capsys):
    """The printed command itself, from the repository root: one fine-tuning step on the embedded
    corpus (its run's length, evaluation and folders the only flags added)."""
    ck = tmp_path / "ck"
    convert(["from-hf", "--load-hf", str(hf_gpt), "--save", str(ck)])
    line = next(line for line in capsys.readouterr().out.splitlines() if "train from it: " in line)
    command = shlex.split(line.split("train from it: ")[1])
    short = ["--train-iters", "1", "--eval-iters", "0", "--log-interval", "1", "--data-cache-path", str(tmp_path / "cache"),
             "--tensorboard-dir", str(tmp_path / "tb")]  # fmt: skip
    done = subprocess.run([*command, *short], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "iteration        1/       1" in done.stdout


def test_to_hf_writes_every_file_with_the_mode_the_umask_gives(dist_ck, tmp_path):
    """safetensors writes through a temporary file of mode 0600; the export's files all get 0666 less
    the umask, as its config files do."""
    for umask, mode in ((0o022, 0o644), (0o027, 0o640)):
        old = os.umask(umask)
        try:
            convert(["to-hf", "--load", str(dist_ck), "--save-hf", str(tmp_path / oct(umask))])
        finally:
            os.umask(old)
        modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / oct(umask)).iterdir()}
        assert "model.safetensors" in modes and set(modes.values()) == {mode}, modes


def test_torch_and_torch_dist_convert_into_each_other(dist_ck, hf_gpt, tmp_path, capsys):
    legacy, again = tmp_path / "legacy", tmp_path / "dist"
    convert(["to-torch", "--load", str(dist_ck), "--save", str(legacy), "--schedule", "gpt_tp"])
    assert "--no-load-optim --no-load-rng" in capsys.readouterr().out
    state = checkpointing.read(os.path.join(iteration_dir(str(legacy), 5), "mp_rank_00", checkpointing.FILENAME))
    assert (state["iteration"], state["consumed_train_samples"], state["consumed_valid_samples"]) == (5, 40, 8)
    assert state["model"]["transformer.wte.weight"].shape == (128, 16)  # padded as a TP1 run pads it
    assert "optimizer" not in state and "rng_state" not in state
    convert(["to-torch-dist", "--load", str(legacy), "--save", str(again)])
    common = dist_checkpoint.read_common(iteration_dir(str(again), 5))
    assert (common["iteration"], common["consumed_train_samples"], common["consumed_valid_samples"]) == (5, 40, 8)
    assert '"lr": 0.001' in common["args"] and not common["has_optimizer"]
    padded = conversion.read(str(dist_ck), None).weights["transformer.wte.weight"]
    assert padded.shape == (128, 16)  # a run's padding rows are saved: they train
    assert torch.equal(conversion.read(str(again), None).weights["transformer.wte.weight"], padded)  # padding kept
    convert(["to-hf", "--load", str(again), "--save-hf", str(tmp_path / "hf")])
    assert_same_model(hf_gpt, tmp_path / "hf")


def test_bad_input_is_one_line(dist_ck, hf_gpt, tmp_path):
    ck = Path(shutil.copytree(dist_ck, tmp_path / "ck"))
    out = ["--save-hf", str(tmp_path / "hf")]
    assert refused(["to-hf", "--load", str(tmp_path / "nope"), *out]) == (
        f"--load {tmp_path / 'nope'} does not exist: give a checkpoint directory (a training run's --save)"
    )
    (tmp_path / "empty").mkdir()
    assert refused(["to-hf", "--load", str(tmp_path / "empty"), *out]).startswith(
        f"--load {tmp_path / 'empty'} holds no checkpoint (no {LATEST})"
    )
    root = Path(iteration_dir(str(ck), 5))
    assert refused(["to-hf", "--load", str(ck), "--iteration", "4", *out]) == (
        f"{iteration_dir(str(ck), 4)} does not exist: --load {ck} holds iterations 5"
    )
    assert refused(["to-torch-dist", "--load", str(ck), "--save", str(tmp_path / "d")]).startswith(
        f"--load {ck}: {root} is in the torch_dist format already"
    )
    assert refused(["to-torch", "--load", str(ck), "--save", str(ck), "--schedule", "gpt_tp"]).startswith(
        f"--save {ck} already holds a checkpoint"
    )
    shard = root / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])  # truncated
    message = refused(["to-hf", "--load", str(ck), *out])
    assert message.startswith(f"checkpoint file {shard} is corrupt: its SHA-256 differs"), message
    shard.unlink()
    assert refused(["to-hf", "--load", str(ck), *out]).startswith(f"checkpoint file {shard} is missing")
    assert not (tmp_path / "hf").exists() and not (tmp_path / "d").exists()
    hf = ["from-hf", "--load-hf", str(hf_gpt), "--ckpt-format", "torch", "--save", str(tmp_path / "d")]
    assert refused(hf).startswith("--ckpt-format torch needs --schedule NAME")
