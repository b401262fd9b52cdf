"""Runs under torchrun: one process group for the whole session, tests in collection order.

Every rank runs the same tests in the same order, so collectives pair up. Tests keep their
collectives before their assertions, so a failing rank does not leave the others waiting.
A test runs at world size 2 unless marked ``@pytest.mark.world_sizes(...)``.
"""

import os

import pytest
import torch.distributed as dist

from megatron_slapo import parallel

WORLD_SIZE = int(os.environ["WORLD_SIZE"])


def pytest_collection_modifyitems(config, items):
    for item in items:
        marker = item.get_closest_marker("world_sizes")
        sizes = marker.args if marker else (2,)
        if WORLD_SIZE not in sizes:
            item.add_marker(pytest.mark.skip(reason=f"runs at world sizes {sizes}, this run has {WORLD_SIZE}"))


def use_layout(tensor_parallel: int) -> None:
    """(Re)initialise megatron-core's groups with this TP size (and no pipeline parallelism: a
    run before may have left some) if they differ; reseeds the RNG."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() != tensor_parallel or ps.get_pipeline_model_parallel_world_size() != 1:
        parallel.initialize(tensor_parallel=tensor_parallel, timeout_minutes=3)
    parallel.seed(1234, ps.get_tensor_model_parallel_rank())


@pytest.fixture(scope="session", autouse=True)
def process_group():
    parallel.initialize(tensor_parallel=WORLD_SIZE, timeout_minutes=3)
    yield
    parallel.destroy()


@pytest.fixture
def group():
    """The tensor-parallel group spanning the whole world (the default schedule group)."""
    use_layout(WORLD_SIZE)
    return parallel.tensor_parallel_group()


@pytest.fixture
def rank():
    return dist.get_rank()


@pytest.fixture
def world():
    return dist.get_world_size()


@pytest.fixture(scope="session")
def shared_tmp(tmp_path_factory):
    """A directory every rank sees (rank 0's temporary directory, broadcast)."""
    path = [str(tmp_path_factory.mktemp("shared")) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


@pytest.fixture(scope="session")
def cache(shared_tmp):
    """The data cache the in-process training runs share (the embedded corpus, prepared once)."""
    return os.path.join(shared_tmp, "cache")
