"""What a checkpoint costs: save and load time and bytes on disk of ``--ckpt-format torch`` against
``torch_dist``, and the step loop's stall under ``--async-save`` against a synchronous save.

    .venv/bin/torchrun --nproc_per_node 2 tools/bench_checkpoint.py [--repeats 3] [--dir DIR] [--json OUT] \\
        -- --schedule gpt_tp --tensor-model-parallel-size 2 --num-layers 4 --hidden-size 256 \\
           --num-attention-heads 8 --seq-length 128 --micro-batch-size 4

Everything after ``--`` is ``pretrain_gpt.py``'s flags (the run's model and layout). In one run
the trainer builds the model and engine once and trains one step (so that the optimizer has its
state); then, alternating between the formats so that machine noise hits both alike, each is
saved ``--repeats`` times into a fresh directory under ``--dir`` (default: a temporary one) and
loaded back into the same engine. A time is the slowest rank's (a barrier before and after).
Bytes are the iteration directory's files. The stall is how long ``save`` holds the step loop
with ``--async-save`` (the copy to CPU memory and the planning; the writing goes on in the
background and is waited for before the next repeat, not timed) against the whole synchronous
``torch_dist`` save. Medians are printed, and with ``--json`` written with every sample.
"""

from __future__ import annotations

if __name__ == "__main__":  # a Python without torch re-runs this with the repo's .venv (tools/repo_python.py)
    import repo_python  # noqa: F401

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from megatron_slapo.arguments.parser import parse_args  # noqa: E402
from megatron_slapo.checkpoints import checkpointing, dist_checkpoint, saved_model  # noqa: E402
from megatron_slapo.checkpoints.checkpoint_files import iteration_dir  # noqa: E402
from megatron_slapo.parallel.collectives import comm_device  # noqa: E402
from megatron_slapo.training import error_report  # noqa: E402
from megatron_slapo.training.loop import train  # noqa: E402
from megatron_slapo.training.run import Run, setup  # noqa: E402


def timed(fn: Callable[..., object], *args: object) -> float:
    """Seconds ``fn(*args)`` takes on the slowest rank."""
    dist.barrier()
    start = time.perf_counter()
    fn(*args)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=comm_device())
    dist.barrier()
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def directory_bytes(root: str) -> int:
    return sum(f.stat().st_size for f in Path(root).rglob("*") if f.is_file())


def _load(run: Run, fmt: str, save_dir: str) -> None:
    args = run.args
    args.load, args.ckpt_format = save_dir, fmt
    path = checkpointing.checkpoint_file(save_dir, run.layout, fmt)
    state = checkpointing.read_checked(args, run.layout, path, saved_model.hf_config(run.metadata))
    checkpointing.load(run.engine, args, run.layout, path, state, run.metadata)


def measure(run: Run, base: str, repeats: int) -> dict[str, dict[str, list[float]]]:
    """Every sample: per format, save and load seconds and bytes; the async stall."""
    args, samples = run.args, {fmt: {"save_s": [], "load_s": [], "bytes": []} for fmt in ("torch", "torch_dist")}
    samples["async"] = {"stall_s": [], "sync_s": []}

    def save(asynchronous: dist_checkpoint.AsyncSaves | None) -> None:
        checkpointing.save(run.engine, args, run.layout, run.resume, run.metadata, run.recorded, asynchronous)

    for repeat in range(repeats):
        for fmt in ("torch", "torch_dist"):
            save_dir = os.path.join(base, f"{fmt}-{repeat}")
            args.save, args.ckpt_format = save_dir, fmt
            samples[fmt]["save_s"].append(timed(save, None))
            samples[fmt]["bytes"].append(directory_bytes(iteration_dir(save_dir, run.resume.iteration)))
            samples[fmt]["load_s"].append(timed(_load, run, fmt, save_dir))
        saves = dist_checkpoint.AsyncSaves()
        args.save, args.ckpt_format = os.path.join(base, f"async-{repeat}"), "torch_dist"
        samples["async"]["stall_s"].append(timed(save, saves))
        saves.wait()
        samples["async"]["sync_s"].append(samples["torch_dist"]["save_s"][-1])
        if dist.get_rank() == 0:
            for name in os.listdir(base):
                shutil.rmtree(os.path.join(base, name), ignore_errors=True)
        dist.barrier()
    return samples


def report(samples: dict[str, dict[str, list[float]]]) -> str:
    med = {fmt: {k: statistics.median(v) for k, v in kinds.items()} for fmt, kinds in samples.items()}
    torch_, dist_, stall = med["torch"], med["torch_dist"], med["async"]
    lines = [
        f"{'format':<12} {'save (s)':>10} {'load (s)':>10} {'MiB on disk':>12}",
        *(f"{fmt:<12} {m['save_s']:>10.3f} {m['load_s']:>10.3f} {m['bytes'] / 2**20:>12.2f}"
          for fmt, m in (("torch", torch_), ("torch_dist", dist_))),  # fmt: skip
        f"torch_dist / torch: save {dist_['save_s'] / torch_['save_s']:.2f}x, load "
        f"{dist_['load_s'] / torch_['load_s']:.2f}x, bytes {dist_['bytes'] / torch_['bytes']:.2f}x",
        f"--async-save holds the step loop {stall['stall_s']:.3f} s against {stall['sync_s']:.3f} s for a synchronous "
        f"torch_dist save: {stall['stall_s'] / stall['sync_s']:.2f}x",
    ]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, rest = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="bench_checkpoint.py", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", help="where the checkpoints go (default: a temporary directory)")
    parser.add_argument("--json")
    ours = parser.parse_args(ours)
    prog = "bench_checkpoint.py"
    with error_report.user_errors(prog):
        args = parse_args("gpt", [*rest, "--train-iters", "1", "--eval-iters", "0", "--log-interval", "1"], prog=prog)
        run = setup(args)
    train(run)  # one step: the optimizer's state exists
    box = [ours.dir or (tempfile.mkdtemp(prefix="bench-checkpoint-") if dist.get_rank() == 0 else None)]
    dist.broadcast_object_list(box, src=0)  # every rank writes under rank 0's directory
    samples = measure(run, box[0], ours.repeats)
    run.reporter.close()
    if dist.get_rank() == 0:
        print(report(samples), flush=True)
        if ours.json:
            Path(ours.json).write_text(json.dumps({"argv": rest, "world_size": dist.get_world_size(),
                                                   "samples": samples}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
