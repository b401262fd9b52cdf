"""tools/convert_checkpoint.py on both checkpoint formats, in one process: exports hold the
checkpoint's weights exactly, round trips through either format are exact, bad input is one line.

The checkpoints are tiny GPT-2s (tied embedding, fused q|k|v). A ``torch_dist`` checkpoint is
written as a TP1 training run writes it (``checkpointing.save``, the vocabulary padded to 128
rows); tests/distributed/test_trainer.py exports one saved by a TP2 run.
"""

from __future__ import annotations

import argparse
import os
import shutil
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
from tools import convert_checkpoint

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
    assert capsys.readouterr().out.endswith(f"wrote {root} (torch_dist: loads at any layout); train from it with "
                                            f"--load {ck} --finetune (or --no-load-optim)\n")  # fmt: skip
    assert dist_checkpoint.is_dist_checkpoint(root) and (ck / LATEST).read_text() == "0"
    common = dist_checkpoint.read_common(root)
    assert common["slapo"]["vocab"]["true"] == common["slapo"]["vocab"]["padded"] == 100  # not padded
    saved = dcp.FileSystemReader(root).read_metadata().state_dict_metadata
    assert tuple(saved["model.transformer.wte.weight"].size) == (100, 16)
    assert "model.lm_head.weight" not in saved and not any(k.startswith("optimizer.") for k in saved)
    convert(["to-hf", "--load", str(ck), "--save-hf", str(tmp_path / "back")])
    assert_same_model(hf_gpt, tmp_path / "back")


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
