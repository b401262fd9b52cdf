"""Context parallelism at a long sequence: memory per rank and step time of a tiny Llama trained by
one process (CP1) against ``--context-parallel-size`` 2 and 4, every layout in one run.

    .venv/bin/python tools/bench_context.py [--seq-length 16384] [--layouts 1 2 4] [--iters 3] \\
        [--memory-budget-mib 4096] [--cp-comm-type p2p] [--json OUT] [--logs DIR]

Each layout is its own ``torchrun --standalone --nproc_per_node C pretrain_gpt.py ...
--context-parallel-size C`` launch (CP1: one process), in turn, training the same model on the same
data: Llama, 2 layers, hidden 64, 4 heads in 2 key/value groups, no dropout, ``--schedule llama_tp``, one
sequence of ``--seq-length`` tokens a step, for ``--iters`` steps. Read from the trainer's log:

- activations per micro-batch and peak, every rank's, as the trainer measures them in its first step
  (``> rank R (tensor, pipeline, data) = ...: activations A MiB per micro-batch | peak P MiB``; on a
  CPU the peak is the most saved activations alive at once plus weights, gradients and optimizer);
  the table shows the largest rank's;
- step time: the mean ``elapsed time per iteration`` over the steps after the first;
- the last step's ``lm loss`` (the layouts train the same model: it should agree).

Max RSS is the largest process's of the launch (``os.wait4``: the launcher and every rank it
waited for), the memory the operating system gave it. Ratios are against the first layout (CP1 by
default), measured in the same run. With ``--memory-budget-mib`` the table says which layouts fit:
every rank's peak within the budget, and on a CPU (where a rank's memory is the host's) the max RSS
too. Each rank runs ``cores // C`` threads unless ``OMP_NUM_THREADS`` is set, so that every layout
has the whole machine; on a machine with fewer cores than ranks, the ranks share cores and the
step time is no speed-up measurement.
"""

from __future__ import annotations

if __name__ == "__main__":  # a Python without torch re-runs this with the repo's .venv (tools/repo_python.py)
    import repo_python  # noqa: F401

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere
MODEL = ["--model-type", "llama", "--schedule", "llama_tp", "--num-layers", "2", "--hidden-size", "64",
         "--num-attention-heads", "4", "--num-query-groups", "2", "--micro-batch-size", "1",
         "--global-batch-size", "1", "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0",
         "--log-interval", "1"]  # fmt: skip  # no dropout (as Llama's pretraining): every layout computes the same
MODEL_TEXT = "Llama, 2 layers, hidden 64, 4 heads in 2 key/value groups, no dropout, llama_tp, micro-batch 1, fp32"

RANK_MEMORY = re.compile(r"> rank (\d+) \(tensor, pipeline, data(?:, context)?\) = \([\d, ]+\): activations ([\d.]+) MiB "
                         r"per micro-batch \| peak ([\d.]+) MiB")  # fmt: skip
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)")
LOSS = re.compile(r"\| lm loss: ([-+\d.Ee]+) \|")


@dataclasses.dataclass
class Measured:
    """One layout's launch, read from its log."""

    cp: int
    activations_mib: list[float]  # per rank, per micro-batch
    peak_mib: list[float]  # per rank
    step_ms: list[float]  # per iteration, in order
    last_loss: float | None
    max_rss_mib: float  # the launch's largest process


def trainer_command(cp: int, seq: int, iters: int, comm: str, scratch: str) -> list[str]:
    """``torchrun`` training the benchmarked model at context-parallel size ``cp``; data cache and
    TensorBoard under ``scratch`` (so that nothing lands in the checkout)."""
    flags = [*MODEL, "--seq-length", str(seq), "--train-iters", str(iters), "--data-cache-path",
             os.path.join(scratch, "cache"), "--tensorboard-dir", os.path.join(scratch, f"tb-cp{cp}")]  # fmt: skip
    if cp > 1:
        flags += ["--context-parallel-size", str(cp), "--cp-comm-type", comm]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cp}"]
    return [*torchrun, str(ROOT / "pretrain_gpt.py"), *flags]


def parse_log(text: str, cp: int, max_rss_mib: float) -> Measured:
    """The trainer's memory lines, iteration lines and losses in ``text``; ValueError if one is missing."""
    ranks = {int(r): (float(a), float(p)) for r, a, p in RANK_MEMORY.findall(text)}
    steps = {int(i): float(ms) for i, ms in ITERATION.findall(text)}
    if sorted(ranks) != list(range(cp)) or not steps:
        raise ValueError(f"the log has no memory line for every one of the {cp} ranks, or no iteration line")
    losses = LOSS.findall(text)
    return Measured(cp, [ranks[r][0] for r in range(cp)], [ranks[r][1] for r in range(cp)],
                    [steps[i] for i in sorted(steps)], float(losses[-1]) if losses else None, max_rss_mib)  # fmt: skip


def launch(command: list[str], threads: int, log: Path) -> tuple[int, float]:
    """Run ``command`` with its output in ``log``: its exit code and the largest process's max RSS (MiB)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)  # its rusage: itself and every process it waited for
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss / 1024  # Linux: KiB


def threads(cp: int) -> int:
    """Threads a rank runs: ``OMP_NUM_THREADS`` if set, else the machine's cores shared by ``cp`` ranks."""
    return int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // cp))


def measure(cp: int, a: argparse.Namespace, scratch: str, logs: Path) -> Measured | str:
    """One layout's run; what went wrong (a line) if it did not train."""
    log = logs / f"cp{cp}.log"
    code, rss = launch(trainer_command(cp, a.seq_length, a.iters, a.cp_comm_type, scratch), threads(cp), log)
    text = log.read_text()
    if code != 0:
        last = next((line for line in reversed(text.splitlines()) if line.strip()), "no output")
        return f"exit code {code}: {last.strip()[:200]}"
    try:
        return parse_log(text, cp, rss)
    except ValueError as error:
        return str(error)


def rows(measured: list[Measured | str], layouts: list[int], budget: float | None, cpu: bool) -> list[dict]:
    """A row per layout: the largest rank's numbers, their ratios against the first layout's, and
    whether the layout fits ``budget`` (MiB)."""
    out: list[dict] = []
    for cp, m in zip(layouts, measured, strict=True):
        if isinstance(m, str):
            out.append({"layout": f"CP{cp}", "ranks": cp, "failed": m})
            continue
        row = {"layout": f"CP{cp}", "ranks": cp, "activations_mib": max(m.activations_mib), "peak_mib": max(m.peak_mib),
               "max_rss_mib": m.max_rss_mib, "step_ms": statistics.mean(m.step_ms[1:] or m.step_ms),
               "last_loss": m.last_loss, "activations_mib_per_rank": m.activations_mib, "peak_mib_per_rank": m.peak_mib,
               "step_ms_per_iteration": m.step_ms}  # fmt: skip
        if budget is not None:
            row["fits_budget"] = row["peak_mib"] <= budget and (not cpu or row["max_rss_mib"] <= budget)
        out.append(row)
    base = out[0]
    for row in out:
        if "failed" not in row and "failed" not in base:
            for key in ("activations_mib", "peak_mib", "max_rss_mib", "step_ms"):
                row[f"{key} vs base"] = row[key] / base[key]
    return out


def _ratio(row: dict, key: str) -> str:
    return f"{row[key + ' vs base']:.2f}x" if key + " vs base" in row else "n/a"


def table(results: list[dict], budget: float | None) -> str:
    """The rows as Markdown, ratios against the first row's."""
    base = results[0]["layout"]
    head = ["layout", "ranks", "activations MiB / micro-batch (largest rank)", f"/ {base}'s", "peak MiB (largest rank)",
            f"/ {base}'s", "max RSS MiB (largest process)", f"/ {base}'s", "step ms", f"/ {base}'s", "last lm loss"]  # fmt: skip
    head += [f"within {budget:g} MiB"] if budget is not None else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        if "failed" in r:
            cells = [r["layout"], str(r["ranks"]), f"failed: {r['failed']}"]
        else:
            cells = [r["layout"], str(r["ranks"]), f"{r['activations_mib']:.1f}", _ratio(r, "activations_mib"),
                     f"{r['peak_mib']:.1f}", _ratio(r, "peak_mib"), f"{r['max_rss_mib']:.0f}", _ratio(r, "max_rss_mib"),
                     f"{r['step_ms']:.0f}", _ratio(r, "step_ms"),
                     f"{r['last_loss']:.6f}" if r["last_loss"] is not None else "n/a"]  # fmt: skip
            cells += [("yes" if r["fits_budget"] else "no")] if budget is not None else []
        lines.append("| " + " | ".join(cells + [""] * (len(head) - len(cells))) + " |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_context.py", description=__doc__.splitlines()[0])
    p.add_argument("--seq-length", type=int, default=16384, help="tokens per sequence (divisible by 2 x each CP size)")
    p.add_argument("--layouts", type=int, nargs="+", default=[1, 2, 4], metavar="C",
                   help="context-parallel sizes, in this order; ratios are against the first")  # fmt: skip
    p.add_argument("--iters", type=int, default=3, help="training steps per layout (the first is not timed)")
    p.add_argument("--cp-comm-type", choices=("p2p", "allgather"), default="p2p", help="the trainer's flag")
    p.add_argument("--memory-budget-mib", type=float, help="say which layouts fit within this much per rank")
    p.add_argument("--json", metavar="FILE", help="write the rows, the command, date and machine as JSON")
    p.add_argument("--logs", metavar="DIR", help="keep each layout's trainer output as DIR/cpC.log")
    return p


def check(a: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """Bad input, one line before anything runs."""
    if min(a.layouts) < 1 or len(set(a.layouts)) != len(a.layouts):
        p.error(f"--layouts {' '.join(map(str, a.layouts))}: give distinct context-parallel sizes of 1 or more")
    if a.iters < 2:
        p.error(f"--iters {a.iters}: give 2 or more (the first step is not timed)")
    if a.memory_budget_mib is not None and a.memory_budget_mib <= 0:
        p.error(f"--memory-budget-mib {a.memory_budget_mib:g} must be positive")
    for cp in a.layouts:
        if a.seq_length < 2 * cp or a.seq_length % (2 * cp):
            p.error(f"--seq-length {a.seq_length} must be a positive multiple of 2 x {cp} (CP{cp} cuts every "
                    f"sequence into {2 * cp} equal chunks)")  # fmt: skip
    for path, what in ((a.json, "--json"), (a.logs, "--logs")):
        parent = Path(path).resolve().parent if path else None
        if parent is not None and not parent.is_dir():
            p.error(f"{what} {path}: directory {parent} does not exist")


def _machine() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}"
    except ImportError:
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"CPU ({os.cpu_count()} cores, {memory:.0f} GiB, no GPU)"


def main(argv: list[str] | None = None) -> None:
    p = parser()
    a = p.parse_args(argv)
    check(a, p)
    machine = _machine()
    with tempfile.TemporaryDirectory(prefix="bench-context-") as scratch:
        logs = Path(a.logs) if a.logs else Path(scratch)
        logs.mkdir(exist_ok=True)
        measured = []
        for cp in a.layouts:
            print(f"bench_context.py: CP{cp} at {a.seq_length} tokens ...", file=sys.stderr, flush=True)
            measured.append(measure(cp, a, scratch, logs))
    results = rows(measured, a.layouts, a.memory_budget_mib, cpu=machine.startswith("CPU"))
    ranks_threads = ", ".join(f"CP{cp} {threads(cp)}" for cp in a.layouts)
    print(f"\ntools/bench_context.py: {MODEL_TEXT}; sequence {a.seq_length}, --cp-comm-type {a.cp_comm_type}; "
          f"{machine}; threads a rank: {ranks_threads}; step time: the mean of the {a.iters - 1} steps after the "
          f"first\n\n{table(results, a.memory_budget_mib)}", flush=True)  # fmt: skip
    if a.json:
        from tools.bench_moe import revision  # the checkout's commit (imports the stack: only here)

        info = {"command": " ".join(["tools/bench_context.py", *(argv if argv is not None else sys.argv[1:])]),
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine,
                "threads_per_rank": {f"CP{cp}": threads(cp) for cp in a.layouts}, "model": MODEL_TEXT,
                "seq_length": a.seq_length, "cp_comm_type": a.cp_comm_type, "memory_budget_mib": a.memory_budget_mib,
                "load_average_1_5_15_min": os.getloadavg(), "commit": revision()}  # fmt: skip
        Path(a.json).write_text(json.dumps({"run": info, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
