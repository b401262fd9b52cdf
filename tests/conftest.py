"""Test-suite layout: ``tests/`` runs in one process; ``tests/distributed/`` runs under torchrun.

A plain ``pytest`` does not collect ``tests/distributed`` directly: ``tests/test_distributed.py``
launches it with ``torchrun --nproc_per_node {2,4} -m pytest tests/distributed`` so that process
start-up (torch, transformers, megatron-core imports) is paid once per world size, not per test.
"""

import os

import pytest

collect_ignore = [] if "WORLD_SIZE" in os.environ else ["distributed"]

# Each torchrun suite's slowest tests (rank 0's --durations block), left by tests/test_distributed.py
# and printed after pytest's own list, whose two slowest entries are those suites as a whole.
_DISTRIBUTED_SLOWEST: dict[int, str] = {}


@pytest.fixture(autouse=True)
def no_process_group_left():
    """A single-process test whose run stops after the (one-rank) process groups started leaves
    none to the next test, so that every test passes alone and in any order. Under torchrun the
    distributed suite keeps its groups from test to test."""
    yield
    if "WORLD_SIZE" not in os.environ:
        from megatron_slapo import parallel

        parallel.destroy()


@pytest.fixture(scope="session")
def slowest_distributed() -> dict[int, str]:
    """World size -> the distributed suite's list of its slowest tests, for the terminal summary."""
    return _DISTRIBUTED_SLOWEST


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for world_size, block in sorted(_DISTRIBUTED_SLOWEST.items()):
        terminalreporter.write_sep("=", f"slowest tests of the distributed suite at world size {world_size} (rank 0)")
        terminalreporter.write_line(block)
