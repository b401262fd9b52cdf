"""torch.distributed internals: c10d's registry of live process groups, the fake backend, its
collective functions replaced by wrappers or found in a traceback, and torchelastic's error file.

Written against torch 2.13.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable, Iterable
from types import TracebackType

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def is_live_group(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` is still registered with c10d (``distributed_c10d._world.pg_map``), so
    ``destroy_process_group(group)`` can shut it down; after ``destroy_process_group()`` (all of
    them) it is not, and destroying it again raises. torch has no public query. torch 2.13."""
    return group in dist.distributed_c10d._world.pg_map


def fake_store() -> dist.Store:
    """A store for ``init_process_group("fake", ...)``: torch's fake process group, whose every
    collective returns at once, moving nothing. It lives in ``torch.testing._internal`` (importing
    it registers the ``"fake"`` backend); torch ships no public one. torch 2.13."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def wrap_collectives(ops: Iterable[str], wrap: Callable[[str, Callable], Callable]) -> dict[str, Callable]:
    """Replace each of torch.distributed's Python collectives named in ``ops`` (those this torch
    has) by ``wrap(op, original)``, process-wide; return the originals replaced, for
    :func:`unwrap_collectives`. Patched in ``distributed_c10d``, where ``P2POp`` and torch's own
    callers look them up, and in ``torch.distributed`` where that re-exports the same function:
    torch has no hook that sees every collective's arguments. torch 2.13."""
    originals = {}
    for op in ops:
        fn = getattr(c10d, op, None)
        if fn is None:
            continue
        originals[op] = fn
        wrapper = wrap(op, fn)
        setattr(c10d, op, wrapper)
        if getattr(dist, op, None) is fn:
            setattr(dist, op, wrapper)
    return originals


def unwrap_collectives(originals: dict[str, Callable]) -> None:
    """Put back the collectives :func:`wrap_collectives` replaced. torch 2.13."""
    for op, fn in originals.items():
        if getattr(dist, op, None) is getattr(c10d, op):
            setattr(dist, op, fn)
        setattr(c10d, op, fn)


def collective_in(tb: TracebackType | None) -> str | None:
    """The innermost public ``torch.distributed`` function (``all_reduce``, ``broadcast``,
    ``barrier``, ``send``...) on the traceback ``tb``, or ``None`` where the failure surfaced
    elsewhere (a ``Work.wait()`` called from C++ or from a library). Relies on those functions
    living in ``distributed_c10d``, behind torch's logging wrappers. torch 2.13."""
    names = [frame.f_code.co_name for frame, _ in traceback.walk_tb(tb) if frame.f_code.co_filename == c10d.__file__]
    public = [name for name in names if not name.startswith("_")]
    return public[-1] if public else None


def record_root_cause(message: str) -> None:
    """Leave ``message`` in torchelastic's error file for this worker (``TORCHELASTIC_ERROR_FILE``,
    which torchrun sets), so that the launcher's failure summary shows it as this rank's failure
    instead of "To enable traceback see ...". The layout is the one
    ``torch.distributed.elastic.multiprocessing.errors.ErrorHandler.record_exception`` writes, less
    its ``py_callstack`` (which the summary would show in place of the message): torch has no
    public call that records a message without a traceback. Nothing outside torchelastic. torch 2.13."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}
    with open(path, "w") as f:
        json.dump(data, f)


def ddp_ignore(module: torch.nn.Module, names: Iterable[str]) -> None:
    """Make torch DDP, wrapped around ``module`` afterwards, leave these parameters' gradients alone
    (``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``: torch 2.x, private)."""
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, list(names))


def traceable_all_reduce_max(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The elementwise maximum of ``x`` over ``group``, as a new tensor, through torch's functional
    collectives (``torch.distributed._functional_collectives``, private): unlike ``dist.all_reduce``
    they trace under torch.compile, so an FP8 layer's amax agreement compiles with the layer.
    torch 2.13."""
    from torch.distributed import _functional_collectives as funcol

    out = funcol.all_reduce(x, "max", group)
    return out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out
