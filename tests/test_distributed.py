"""Launch the distributed suite (``tests/distributed``) under torchrun with gloo, 2 and 4 ranks.

Each world size is one torchrun job running pytest on every rank; this test passes when every
rank's pytest passes, and otherwise shows each failing rank's report.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _rank_logs(log_dir: Path) -> dict[int, str]:
    logs = {}
    for out in sorted(log_dir.glob("*/attempt_*/*/stdout.log")):
        err = out.with_name("stderr.log")
        logs[int(out.parent.name)] = out.read_text() + (err.read_text() if err.exists() else "")
    return logs


@pytest.mark.parametrize("world_size", [2, 4])
def test_distributed_suite(world_size: int, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world_size}",
        "--log-dir",
        str(tmp_path),
        "--redirects",
        "3",
        "-m",
        "pytest",
        "tests/distributed",
        "-q",
        "-rfE",
    ]
    markexpr = request.config.getoption("markexpr")
    if markexpr:
        cmd += ["-m", markexpr]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    logs = _rank_logs(tmp_path)
    report = "\n".join(f"===== rank {r} =====\n{text[-6000:]}" for r, text in logs.items())
    assert proc.returncode == 0, (
        f"distributed suite failed at world size {world_size}:\n{report}\n{proc.stderr[-3000:]}"
    )
    assert logs and all(" passed" in text for text in logs.values()), f"no test ran:\n{report}"
    print(logs[0].strip().splitlines()[-1])
