"""One torchrun per node of a SLURM job: the node's command, built from SLURM's environment.

    srun --ntasks-per-node 1 python tools/launch_node.py --nproc-per-node 8 -- pretrain_gpt.py ARGS...
    .venv/bin/python tools/launch_node.py --dry-run --nproc-per-node 8 -- pretrain_gpt.py ARGS...

Each node runs ``torchrun --nnodes N --node_rank R --nproc_per_node G --master_addr A --master_port P``
with the same entry script and arguments: N and the hosts come from ``SLURM_JOB_NODELIST`` (expanded
as ``scontrol show hostnames`` does), R from ``SLURM_NODEID`` (srun numbers the nodes in that
order), A is the first host. The port is ``MASTER_PORT`` if set, else 29500 plus the job id modulo
1000, so that jobs sharing a first node rarely collide (set ``MASTER_PORT`` where they would).
``MASTER_ADDR`` overrides the first host (a test runs every "node" on loopback).
``--dry-run`` prints every node's command instead of running this node's.
"""

from __future__ import annotations

if __name__ == "__main__":  # a Python without torch re-runs this with the repo's .venv (tools/repo_python.py)
    import repo_python  # noqa: F401

import argparse
import os
import re
import shlex
import shutil
import sys
from collections.abc import Mapping

DEFAULT_PORT = 29500


def expand_hostlist(spec: str) -> list[str]:
    """SLURM's compressed host list (``gpu[01-03,07],login``) as host names, in order."""
    hosts = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", spec):  # commas inside brackets do not split
        hosts += _expand_item(item)
    return hosts


def _expand_item(item: str) -> list[str]:
    bracket = re.search(r"\[([^\]]*)\]", item)
    if bracket is None:
        return [item]
    prefix, rest = item[: bracket.start()], _expand_item(item[bracket.end() :])
    names = []
    for part in bracket.group(1).split(","):
        low, _, high = part.partition("-")
        numbers = range(int(low), int(high or low) + 1)
        names += [f"{prefix}{n:0{len(low)}d}{tail}" for n in numbers for tail in rest]  # keeps zero padding
    return names


def node_commands(entry: list[str], nproc_per_node: int, env: Mapping[str, str]) -> list[tuple[str, list[str]]]:
    """(host, command) for every node of the job, in node-rank order."""
    spec = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not spec:
        raise SystemExit("launch_node.py: SLURM_JOB_NODELIST is not set (run it under srun, or set it for --dry-run)")
    hosts = expand_hostlist(spec)
    port = env.get("MASTER_PORT") or str(DEFAULT_PORT + int(env.get("SLURM_JOB_ID", "0")) % 1000)
    launcher = _torchrun()
    common = ["--nnodes", str(len(hosts)), "--nproc_per_node", str(nproc_per_node),
              "--master_addr", env.get("MASTER_ADDR") or hosts[0], "--master_port", port]  # fmt: skip
    return [(host, [*launcher, *common[:2], "--node_rank", str(rank), *common[2:], *entry])
            for rank, host in enumerate(hosts)]  # fmt: skip


def _torchrun() -> list[str]:
    """``torchrun`` of this Python's environment (or on the PATH), else the module it runs."""
    for candidate in (os.path.join(os.path.dirname(sys.executable), "torchrun"), shutil.which("torchrun")):
        if candidate and os.access(candidate, os.X_OK):
            return [candidate]
    return [sys.executable, "-m", "torch.distributed.run"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc-per-node", type=int, required=True, help="processes (GPUs) per node")
    p.add_argument("--dry-run", action="store_true", help="print every node's command; run nothing")
    p.add_argument("entry", nargs=argparse.REMAINDER, help="-- the script and its arguments")
    a = p.parse_args(argv)
    entry = a.entry[1:] if a.entry[:1] == ["--"] else a.entry
    if not entry:
        p.error("give the entry script and its arguments after --")
    commands = node_commands(entry, a.nproc_per_node, os.environ)
    if a.dry_run:
        for host, command in commands:
            print(f"[{host}] {shlex.join(command)}")
        return
    rank = int(os.environ.get("SLURM_NODEID", "0"))
    host, command = commands[rank]
    print(f"[{host}] {shlex.join(command)}", flush=True)
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
