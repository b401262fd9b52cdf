"""Nothing is ever lost: what a run or a conversion writes is checked before any compute, and a
checkpoint that is corrupt, diverged or someone else's is refused in one line.

Each refusal asserts a non-zero exit, one line naming the flag or file, no traceback, and that no
file that existed before changed (the directory's hash before and after). The runs are tiny and
in-process; one checkpoint (iterations 1 and 2) is trained once and copied for each case.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from megatron_slapo import parallel
from megatron_slapo.arguments.output_paths import check_output_dir, check_output_file
from megatron_slapo.checkpoints import checkpoint_integrity, checkpointing
from megatron_slapo.checkpoints.checkpointing import FILENAME, LATEST, iteration_dir
from megatron_slapo.errors import ConfigError
from megatron_slapo.training.loop import pretrain
from tools import convert_checkpoint

RUN = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--num-layers", "2",
       "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "2",
       "--train-iters", "2", "--lr", "1e-3", "--eval-iters", "0", "--log-interval", "1",
       "--ckpt-format", "torch"]  # fmt: skip  # the legacy files; torch_dist's: tests/test_dist_checkpoint.py


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A checkpoint of iterations 1 and 2 (latest 2), with checksums."""
    ck = tmp_path_factory.mktemp("trained") / "ck"
    pretrain("gpt", [*RUN, "--save", str(ck), "--save-interval", "1"])
    parallel.destroy()
    return ck


@pytest.fixture
def ck(trained, tmp_path) -> Path:
    """This test's own copy of the trained checkpoint."""
    return Path(shutil.copytree(trained, tmp_path / "ck"))


def tree(root: Path) -> dict[str, str]:
    """Every file and directory under ``root`` -> its content's hash (a directory: "dir")."""
    return {str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}  # fmt: skip


def refused(argv: list[str], capsys, watched: Path, task: str = "gpt") -> str:
    """Run ``pretrain`` and return its one error line's message, checking that it exited non-zero
    with that line alone (no traceback) and left every file under ``watched`` as it was."""
    before = tree(watched)
    with pytest.raises(SystemExit) as exit_:
        pretrain(task, argv)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert exit_.value.code not in (0, None) and len(lines) == 1, err
    assert lines[0].startswith(f"pretrain_{task}.py: error: ")
    assert "iteration        1/" not in out  # refused before the first step
    assert tree(watched) == before
    return lines[0].removeprefix(f"pretrain_{task}.py: error: ")


def converter_refused(argv: list[str], watched: Path) -> str:
    before = tree(watched)
    with pytest.raises(SystemExit) as exit_:
        convert_checkpoint.main(argv)
    line = str(exit_.value.code)
    assert "\n" not in line and line.startswith("convert_checkpoint.py: error: "), line
    assert tree(watched) == before
    return line.removeprefix("convert_checkpoint.py: error: ")


# -- output paths: checked before any compute, nothing created --------------------------------------------------------


def test_output_path_checks_name_the_flag_and_create_nothing(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"^--save .*/file is a file, but --save needs a directory"):
        check_output_dir("--save", str(tmp_path / "file"))
    with pytest.raises(ConfigError, match=r"^--save .*/file/ck: .*/file is a file, not a directory"):
        check_output_dir("--save", str(tmp_path / "file" / "ck"))
    with pytest.raises(ConfigError, match=r"^--json .* is a directory, but --json needs a file"):
        check_output_file("--json", str(tmp_path))
    with pytest.raises(ConfigError, match=r"^--json .*/file/x.json: .*/file is a file, not a directory"):
        check_output_file("--json", str(tmp_path / "file" / "x.json"))
    check_output_dir("--save", str(tmp_path / "new" / "deeper"))  # may be created: fine, but not created here
    check_output_file("--json", str(tmp_path / "new" / "x.json"))
    check_output_file("--json", str(tmp_path / "file"))  # an existing file is overwritten: fine
    assert sorted(os.listdir(tmp_path)) == ["file"]  # no probe file, no directory left behind


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_an_unwritable_directory_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    with pytest.raises(ConfigError, match=r"^--tensorboard-dir .*/locked/tb: cannot write there \(in .*/locked\)"):
        check_output_dir("--tensorboard-dir", str(locked / "tb"))


@pytest.mark.parametrize("flag", ["--save", "--tensorboard-dir"])
def test_a_run_writing_to_a_file_is_refused_before_training(flag, tmp_path, capsys):
    (tmp_path / "file").write_text("keep me")
    message = refused([*RUN, flag, str(tmp_path / "file")], capsys, tmp_path)
    assert message == f"{flag} {tmp_path / 'file'} is a file, but {flag} needs a directory: give another path"


# -- a run never overwrites iterations it did not load from --------------------------------------------------------


def test_a_new_run_does_not_overwrite_an_existing_checkpoint(ck, capsys):
    message = refused([*RUN, "--save", str(ck)], capsys, ck)
    assert message.startswith(f"--save {ck} already holds iteration(s) 1, 2, which this run (starting at iteration 0)")
    assert f"pass --load {ck};" in message and "--overwrite-checkpoints" in message


def test_finetuning_into_the_loaded_directory_is_refused(ck, capsys):
    message = refused([*RUN, "--load", str(ck), "--save", str(ck), "--finetune"], capsys, ck)
    assert message.startswith(f"--save {ck} already holds iteration(s) 1, 2, which this run (starting at iteration 0)")
    assert f"pass --load {ck} without --finetune" in message


def test_loading_one_checkpoint_into_another_that_holds_later_iterations_is_refused(ck, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(ck, other)
    (other / LATEST).write_text("1")  # resumes at 1; --save still holds 2
    message = refused([*RUN, "--load", str(other), "--save", str(ck)], capsys, tmp_path)
    assert message.startswith(f"--save {ck} already holds iteration(s) 2, which this run (starting at iteration 1)")


def test_overwrite_checkpoints_writes_over_them(ck, capsys):
    pretrain("gpt", [*RUN, "--save", str(ck), "--train-iters", "1", "--overwrite-checkpoints"])
    assert checkpointing.latest_iteration(str(ck)) == 1 and checkpointing.saved_iterations(str(ck)) == [1, 2]


# -- checksums and non-finite values ------------------------------------------------------------------------------------


def rank_file(ck: Path, iteration: int = 2) -> Path:
    return Path(iteration_dir(str(ck), iteration)) / "mp_rank_00" / FILENAME


def test_every_saved_file_has_a_checksum(ck):
    root = Path(iteration_dir(str(ck), 2))
    recorded = checkpoint_integrity.recorded_checksums(str(root))
    assert recorded == {"mp_rank_00/" + FILENAME: hashlib.sha256(rank_file(ck).read_bytes()).hexdigest()}


def test_a_bit_flipped_checkpoint_is_refused(ck, capsys):
    data = bytearray(rank_file(ck).read_bytes())
    data[len(data) // 2] ^= 0x10
    rank_file(ck).write_bytes(data)
    message = refused([*RUN, "--load", str(ck), "--train-iters", "3"], capsys, ck)
    assert message.startswith(f"checkpoint file {rank_file(ck)} is corrupt: its SHA-256 differs")


def rewrite(ck: Path, change) -> None:
    """Change iteration 2's file as a run would have saved it (its checksums recorded anew)."""
    state = torch.load(rank_file(ck), weights_only=True)
    change(state)
    torch.save(state, rank_file(ck))
    checkpoint_integrity.write_checksums(iteration_dir(str(ck), 2))


def _nan_weight(state):
    state["model"]["transformer.h.1.mlp.c_fc.weight"][0, 0] = float("nan")


def _nan_lr(state):
    state["optimizer"]["param_groups"][0]["lr"] = float("nan")


def _inf_recorded_lr(state):
    state["args"] = json.dumps({**json.loads(state["args"]), "lr": float("inf")})


@pytest.mark.parametrize(
    "change, found",
    [
        (_nan_weight, "holds a non-finite value at model['transformer.h.1.mlp.c_fc.weight']: it was saved from a "
                      "diverged run or is corrupt"),
        (_nan_lr, "holds a non-finite value at optimizer['param_groups'][0]['lr'] = nan"),
        (_inf_recorded_lr, "records a non-finite hyper-parameter, args['lr'] = inf"),
    ],
    ids=["weight", "optimizer-lr", "recorded-lr"],
)  # fmt: skip
def test_non_finite_values_are_refused(change, found, ck, capsys):
    rewrite(ck, change)
    message = refused([*RUN, "--load", str(ck), "--save", str(ck), "--train-iters", "3"], capsys, ck)
    assert message.startswith(f"checkpoint {rank_file(ck)} {found}"), message


def test_a_checkpoint_without_checksums_still_loads_and_says_so_once(ck, capsys):
    (Path(iteration_dir(str(ck), 2)) / checkpoint_integrity.MANIFEST).unlink()
    state = pretrain("gpt", [*RUN, "--load", str(ck), "--save", str(ck), "--train-iters", "3"])
    out = capsys.readouterr().out
    assert state.iteration == 3 and out.count("checksums.sha256 (saved before checksums were recorded)") == 1, out
    assert checkpoint_integrity.recorded_checksums(iteration_dir(str(ck), 3))  # the new iteration has them


def test_a_checkpoint_of_another_depth_says_so(ck, capsys):
    argv = [*RUN, "--load", str(ck), "--train-iters", "3", "--num-layers", "3"]
    assert refused(argv, capsys, ck) == (f"{rank_file(ck)} holds a model of 2 layers, this run builds 3: give "
                                         "--num-layers 2, or another --load")  # fmt: skip


# -- a corruption no check at load can see: the run stops on its NaN steps and saves none of them --------------------

# no data-loader workers: a run stopped mid-training leaves its loader to the test's traceback, whose workers take
# seconds to join at teardown
DIST_RUN = [*RUN[:-2], "--ckpt-format", "torch_dist", "--num-workers", "0"]


@pytest.fixture(scope="module")
def trained_dist(tmp_path_factory) -> Path:
    """A torch_dist checkpoint of iteration 2."""
    ck = tmp_path_factory.mktemp("trained-dist") / "ck"
    pretrain("gpt", [*DIST_RUN, "--save", str(ck)])
    parallel.destroy()
    return ck


def flip_exponent(root: Path, name: str) -> None:
    """Flip a bit of the exponent of tensor ``name``'s middle element where the iteration ``root``
    stores it (its shard file, at the offset DCP's metadata gives): a weight of about 1e-2 becomes
    about 1e36, finite, so that the checks at load pass it."""
    import io

    import torch.distributed.checkpoint as dcp

    storage = dcp.FileSystemReader(str(root)).read_metadata().storage_data
    (where,) = [item for index, item in storage.items() if index.fqn == name]
    path = root / where.relative_path
    data = bytearray(path.read_bytes())
    saved = bytes(data[where.offset : where.offset + where.length])
    values = torch.load(io.BytesIO(saved), weights_only=True).flatten()
    middle = values[values.numel() // 2 :][:1].numpy().tobytes()
    assert saved.count(middle) == 1
    data[where.offset + saved.index(middle) + 3] ^= 0x40  # little-endian fp32: its last byte holds the exponent
    path.write_bytes(data)


@pytest.mark.parametrize("iterations, streak", [(4, 2), (20, 5)], ids=["ends-first", "max-consecutive"])
def test_a_corrupt_shard_without_checksums_stops_on_its_nan_steps_and_saves_none(iterations, streak, trained_dist,
                                                                                  tmp_path, capsys):  # fmt: skip
    """Its checksums deleted, the bit-flipped shard loads (with a note that it is not verified) and
    every step is NaN and skipped: the run stops, after --max-consecutive-nan-iterations (5) of
    them or where it would end, without saving (--save-interval 1) or evaluating that state."""
    ck = Path(shutil.copytree(trained_dist, tmp_path / "ck"))
    root = Path(iteration_dir(str(ck), 2))
    (root / checkpoint_integrity.MANIFEST).unlink()
    flip_exponent(root, "model.transformer.h.0.mlp.c_fc.weight")
    argv = [*DIST_RUN, "--load", str(ck), "--save", str(ck), "--save-interval", "1", "--train-iters", str(iterations),
            "--eval-iters", "1", "--eval-interval", "100"]  # fmt: skip
    assert refused(argv, capsys, ck) == (
        f"stopping at iteration {2 + streak}: {streak} consecutive iterations had a NaN/inf loss or gradient, every "
        f"one since it resumed from iteration 2 of --load {ck}: that checkpoint may be corrupt (load an earlier "
        "iteration); that state is not saved"
    )


def test_a_sound_run_whose_last_step_is_skipped_still_saves_its_weights(tmp_path, monkeypatch):
    """A skipped step leaves the weights as they were: a run whose steps were sound before its last,
    non-finite one ends as usual, its final checkpoint saved (only a run of none but such steps,
    above, stops without saving)."""
    from megatron_slapo.engines.base import StepResult

    steps = []

    def diverging(result: StepResult) -> bool:  # the loop reads it once a step, the log line after it
        steps.append(id(result))
        return len(set(steps)) == 3

    monkeypatch.setattr(StepResult, "diverging", property(diverging))
    ck = tmp_path / "ck"
    state = pretrain("gpt", [*DIST_RUN, "--train-iters", "3", "--save", str(ck)])
    parallel.destroy()
    assert state.iteration == 3 and checkpointing.latest_iteration(str(ck)) == 3


# -- the converter ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_model(trained, tmp_path_factory) -> Path:
    hf = tmp_path_factory.mktemp("hf") / "gpt"
    convert_checkpoint.main(["to-hf", "--load", str(trained), "--save-hf", str(hf)])
    return hf


def test_to_hf_refuses_a_file_an_hf_model_and_a_checkpoint(trained, hf_model, tmp_path):
    (tmp_path / "file").write_text("keep me")
    load = ["to-hf", "--load", str(trained), "--save-hf"]
    message = converter_refused([*load, str(tmp_path / "file")], tmp_path)
    assert message == f"--save-hf {tmp_path / 'file'} is a file, but --save-hf needs a directory: give another path"
    message = converter_refused([*load, str(hf_model)], hf_model)
    assert message.startswith(f"--save-hf {hf_model} already holds an HF model (config.json, model.safetensors)")
    message = converter_refused([*load, str(trained)], trained)
    assert message.startswith(f"--save-hf {trained} already holds a checkpoint")


def test_from_hf_refuses_a_checkpoint_directory_and_a_file(ck, hf_model, tmp_path):
    (tmp_path / "file").write_text("keep me")
    argv = ["from-hf", "--load-hf", str(hf_model), "--schedule", "gpt_tp", "--save"]
    message = converter_refused([*argv, str(ck)], tmp_path)
    assert message.startswith(f"--save {ck} already holds a checkpoint ({LATEST}, iter_*): converting into it would "
                              "replace its latest iteration")  # fmt: skip
    message = converter_refused([*argv, str(tmp_path / "file")], tmp_path)
    assert message == f"--save {tmp_path / 'file'} is a file, but --save needs a directory: give another path"


def test_from_hf_bad_sources_and_a_missing_launcher(hf_model, tmp_path):
    config_only, malformed = tmp_path / "config-only", tmp_path / "malformed"
    config_only.mkdir()
    shutil.copy(hf_model / "config.json", config_only)
    shutil.copytree(hf_model, malformed)
    (malformed / "config.json").write_text('{"model_type": "gpt2",')
    argv = ["from-hf", "--schedule", "gpt_tp", "--save", str(tmp_path / "out"), "--load-hf"]
    assert converter_refused([*argv, str(config_only)], tmp_path) == (
        f"--load-hf {config_only} has a config.json but no weights (model.safetensors or pytorch_model.bin): give a "
        "directory written by save_pretrained or to-hf"
    )
    message = converter_refused([*argv, str(malformed)], tmp_path)
    assert message.startswith(f"--load-hf {malformed}/config.json cannot be read: ") and "JSON" in message
    message = converter_refused([*argv, str(hf_model), "--tensor-model-parallel-size", "2", "--ckpt-format", "torch"],
                                tmp_path)  # fmt: skip
    assert message.startswith("--tensor-model-parallel-size 2 needs a multiple of 2 processes, one per rank, and this "
                              "is 1: run it as torchrun --nproc_per_node 2")  # fmt: skip
    assert not (tmp_path / "out").exists()


def test_a_finished_run_loaded_again_trains_nothing_and_writes_nothing(ck, capsys):
    """--load at or past --train-iters: said in one line, the checkpoint left as it was."""
    before = tree(ck)
    argv = [*RUN, "--train-iters", "1", "--load", str(ck), "--save", str(ck), "--save-interval", "1"]
    assert pretrain("gpt", argv).iteration == 2
    out = capsys.readouterr().out
    assert "> nothing to train: the checkpoint is at iteration 2, --train-iters is 1 (raise it to train further)" in out
    assert "iteration        1/" not in out and "iteration        2/" not in out
    assert tree(ck) == before
