"""``--ckpt-format torch_dist`` in one process: what it writes, the flags around it, and every bad
checkpoint refused in one line before training, nothing already saved modified.

The checkpoint (iterations 1 and 2) is trained once, in-process, and copied for each case;
resharding across layouts and engines is tests/test_reshard.py's (real launches, the slow tier) and
tests/distributed/test_engines.py's (one process's checkpoint at other layouts, the README's suite).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_slapo import parallel
from megatron_slapo.checkpoints import checkpointing, dist_checkpoint
from megatron_slapo.checkpoints.checkpoint_files import iteration_dir
from megatron_slapo.training.loop import pretrain
from tests.test_nothing_lost import refused
from tests.utils import tb_scalars

RUN = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--num-layers", "2",
       "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "2",
       "--lr", "1e-3", "--eval-iters", "0", "--log-interval", "1"]  # fmt: skip
FIVE = ["--train-iters", "5", "--hidden-dropout", "0", "--attention-dropout", "0"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A torch_dist checkpoint of iterations 1 and 2 (latest 2) of a 5-iteration run."""
    ck = tmp_path_factory.mktemp("dist") / "ck"
    pretrain("gpt", [*RUN, *FIVE, "--save", str(ck), "--save-interval", "1", "--exit-interval", "2"])
    parallel.destroy()
    return ck


@pytest.fixture
def ck(trained, tmp_path) -> Path:
    return Path(shutil.copytree(trained, tmp_path / "ck"))


def test_the_layout_is_megatrons_torch_dist(ck):
    root = Path(iteration_dir(str(ck), 2))
    assert json.loads((root / dist_checkpoint.FORMAT_FILE).read_text())["sharded_backend"] == "torch_dist"
    assert dist_checkpoint.is_dist_checkpoint(str(root)) and (root / dist_checkpoint.COMMON).is_file()
    saved = dcp.FileSystemReader(str(root)).read_metadata().state_dict_metadata
    # each tensor once, by its HF name; the tied LM head under the embedding's name
    assert "model.transformer.wte.weight" in saved and "model.lm_head.weight" not in saved
    assert "optimizer.transformer.h.0.attn.c_attn.weight.exp_avg_sq" in saved
    common = dist_checkpoint.read_common(str(root))
    assert common["iteration"] == 2 and common["layout"]["tensor"] == 1 and common["has_optimizer"]


def test_resuming_continues_the_same_run(ck, tmp_path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    pretrain("gpt", [*RUN, *FIVE, "--tensorboard-dir", str(whole)])
    parallel.destroy()
    pretrain("gpt", [*RUN, *FIVE, "--load", str(ck), "--save", str(ck), "--tensorboard-dir", str(resumed)])
    parallel.destroy()
    losses, again = tb_scalars(str(whole), "lm loss"), tb_scalars(str(resumed), "lm loss")
    assert sorted(again) == [3, 4, 5]
    assert all(again[i] == pytest.approx(losses[i], rel=1e-6) for i in again)


@pytest.mark.parametrize("flag, starts_at", [("--finetune", 0), ("--no-load-optim", 2)])
def test_finetune_and_no_load_optim_load_the_weights(flag, starts_at, ck, tmp_path, capsys):
    state = pretrain("gpt", [*RUN, *FIVE, "--load", str(ck), flag, "--save", str(tmp_path / "new")])
    parallel.destroy()
    out = capsys.readouterr().out
    assert f"training from iteration {starts_at} to 5" in out and state.iteration == 5


def test_a_torch_dist_checkpoint_loaded_as_torch_says_which_format_it_found(ck, capsys):
    message = refused([*RUN, *FIVE, "--load", str(ck), "--ckpt-format", "torch"], capsys, ck)
    assert "is a checkpoint in the torch_dist format" in message and "--ckpt-format torch_dist" in message


def test_a_truncated_or_missing_shard_file_is_named(ck, capsys):
    shard = next(Path(iteration_dir(str(ck), 2)).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    assert shard.name in refused([*RUN, *FIVE, "--load", str(ck)], capsys, ck)
    shard.unlink()
    assert shard.name in refused([*RUN, *FIVE, "--load", str(ck)], capsys, ck)


def test_a_checkpoint_of_another_shape_names_the_first_tensor_that_differs(ck, capsys):
    argv = [*RUN, *FIVE, "--load", str(ck), "--no-load-optim"]
    message = refused([*argv[: argv.index("--hidden-size") + 1], "64", *argv[argv.index("--hidden-size") + 2 :]],
                      capsys, ck)  # fmt: skip
    assert "model.transformer.wte.weight of shape" in message and "this model's is" in message


def test_non_finite_values_are_refused(tmp_path, capsys, monkeypatch):
    """A checkpoint whose weights hold a NaN (saved so here by spoiling one box as it is written)."""
    ck, spoiled_key = tmp_path / "ck", "model.transformer.h.0.mlp.c_fc.weight"
    pieces_of = dist_checkpoint.pieces_of

    def spoiled(*args):
        pieces = pieces_of(*args)
        box, t = pieces[spoiled_key][1][0]
        pieces[spoiled_key][1][0] = (box, torch.full_like(t, float("nan")))
        return pieces

    monkeypatch.setattr(dist_checkpoint, "pieces_of", spoiled)
    pretrain("gpt", [*RUN, *FIVE, "--save", str(ck), "--exit-interval", "1"])
    parallel.destroy()
    monkeypatch.undo()
    capsys.readouterr()  # the saving run's output
    message = refused([*RUN, *FIVE, "--load", str(ck)], capsys, ck)
    assert f"holds non-finite values in {spoiled_key}" in message


@pytest.mark.parametrize(
    "flags, found",
    [(["--async-save", "--ckpt-format", "torch"], "--async-save needs --ckpt-format torch_dist"),
     (["--ckpt-fully-parallel-load"], "--ckpt-fully-parallel-load is not offered")],
)  # fmt: skip
def test_flags_the_format_does_not_offer_are_refused(flags, found, tmp_path, capsys):
    assert found in refused([*RUN, *flags, "--save", str(tmp_path / "ck")], capsys, tmp_path)


def test_explain_says_how_a_checkpoint_loads(ck):
    args = argparse.Namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=1, engine="megatron")
    text = checkpointing.describe_load(str(ck), args, world=4)
    assert "saved at TP1 x PP1 x DP1, megatron; this run: TP2 x PP1 x DP2, megatron (resharding)" in text
