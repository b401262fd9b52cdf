"""Launch the distributed suite (``tests/distributed``) under torchrun with gloo, 2 and 4 ranks.

Each world size is one torchrun job running pytest on every rank; this test passes when every
rank's pytest passes, and otherwise shows each failing rank's report. A distributed test that
skipped would pass unseen here, so rank 0's skips are read from its report (``-rs``): a test for
the other world size skips as expected; a machine that cannot build kernels
(the compiler probe's own answer) is a warning with its count; any other skip fails this test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# The skip that is not a problem: tests/distributed/conftest.py's, of a test marked for other world sizes
EXPECTED_SKIPS = re.compile(r"^runs at world sizes ")
NO_COMPILER = "cannot build kernels on"  # tests/utils.py:require_compiler's skip (compiler_problem's reason)
SKIPPED = re.compile(r"^SKIPPED \[(\d+)\] (\S+): (.*)$", re.M)  # pytest -rs: count, location, reason
DURATIONS = re.compile(r"^=+ slowest \d+ durations =+\n(.*?)(?=^\n|^=|\Z)", re.M | re.S)
SUMMARY = re.compile(r"^=*\s*(\d+ (?:passed|failed|skipped|deselected|errors?)\b.*) in [\d.]+s", re.M)


def summary_line(report: str) -> str:
    """The last line of a pytest report that sums it up (``12 passed, 3 skipped in 9.1s``)."""
    found = SUMMARY.findall(report)
    assert found, f"no pytest summary line in:\n{report[-3000:]}"
    return found[-1]


def skips(report: str) -> tuple[int, dict[str, int]]:
    """The skipped count of a pytest report's summary line, and those of its ``-rs`` lines
    (``location: reason`` -> count) whose reason is not an expected one."""
    found = re.search(r"(\d+) skipped", summary_line(report))
    listed = {f"{where}: {why}": int(n) for n, where, why in SKIPPED.findall(report)}
    assert sum(listed.values()) == (int(found.group(1)) if found else 0), f"unreadable skips in:\n{report[-3000:]}"
    return sum(listed.values()), {k: n for k, n in listed.items() if not EXPECTED_SKIPS.search(k.split(": ", 1)[1])}


def _rank_logs(log_dir: Path) -> dict[int, str]:
    logs = {}
    for out in sorted(log_dir.glob("*/attempt_*/*/stdout.log")):
        err = out.with_name("stderr.log")
        logs[int(out.parent.name)] = out.read_text() + (err.read_text() if err.exists() else "")
    return logs


# The slow tier (-m slow) runs the distributed tests marked slow, at two and four ranks: through these launches,
# since the inner pytest takes the outer one's -m.
@pytest.mark.parametrize("world_size", [2, 4, pytest.param(2, marks=pytest.mark.slow, id="2-slow"),
                                        pytest.param(4, marks=pytest.mark.slow, id="4-slow")])  # fmt: skip
def test_distributed_suite(
    world_size: int, tmp_path: Path, request: pytest.FixtureRequest, slowest_distributed: dict[int, str]
) -> None:
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
        "-rfEs",
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
    check_skips(logs[0], world_size)
    slowest = DURATIONS.search(logs[0])  # pyproject's --durations reaches the ranks' pytest too
    if slowest:
        slowest_distributed[world_size] = slowest.group(1).rstrip()
    print(summary_line(logs[0]))


def check_skips(report: str, world_size: int) -> None:
    """Fail on a skip in rank 0's ``report`` that is not expected; warn, with their count, of the
    tests a machine without a working compiler skips."""
    _, unexpected = skips(report)
    no_compiler = {k: n for k, n in unexpected.items() if NO_COMPILER in k}
    if no_compiler:
        warnings.warn(f"{sum(no_compiler.values())} distributed tests skipped at world size {world_size}: "
                      f"{next(iter(no_compiler))}", stacklevel=2)  # fmt: skip
    others = "\n".join(f"  {n} x {k}" for k, n in unexpected.items() if k not in no_compiler)
    assert not others, f"distributed tests skipped at world size {world_size}:\n{others}"


def test_a_skipped_distributed_test_fails_the_suite(tmp_path: Path) -> None:
    """A pytest report as rank 0 writes it (-q -rfEs), of tests skipped for the other world size, for
    want of a compiler and for other reasons (a GPU, not written yet): only the last two fail the suite."""
    (tmp_path / "test_skips.py").write_text(
        "import pytest\n"
        "@pytest.mark.skip(reason='runs at world sizes (4,), this run has 2')\n"
        "@pytest.mark.parametrize('i', range(3))\n"
        "def test_other_world_size(i): pass\n"
        "def test_compile(): pytest.skip(\"torch.compile(backend='inductor') cannot build kernels on cpu: X\")\n"
        "def test_passes(): pass\n"
    )
    run = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "test_skips.py"]
    report = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, timeout=120).stdout
    assert skips(report)[0] == 4 and summary_line(report).startswith("1 passed, 4 skipped")
    with pytest.warns(UserWarning, match="1 distributed tests skipped at world size 2: test_skips.py:5: torch"):
        check_skips(report, 2)
    with open(tmp_path / "test_skips.py", "a") as f:
        f.write("def test_gpu(): pytest.skip('needs a CUDA device')\n")
        f.write("def test_not_yet(): pytest.skip('not written yet')\n")
    report = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, timeout=120).stdout
    with pytest.raises(
        AssertionError,
        match=r"size 2:\n +1 x test_skips.py:7: needs a CUDA device\n +1 x test_skips.py:8: not written yet",
    ):
        with pytest.warns(UserWarning):
            check_skips(report, 2)
