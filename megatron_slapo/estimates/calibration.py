"""Measuring the machine this runs on, and fitting a hardware profile's numbers to what was measured.

What ``tools/calibrate.py`` runs (it assembles the profile :mod:`.hardware` reads). Each measurement
times what the time model later predicts, as the trainer pays it: eager PyTorch calls from Python,
one call after another, timed after a warm-up by the median of a few samples (on a GPU, each
sample ends with a synchronisation); a collective by the mean of its calls, each after some compute
of every rank's own and with a new result, as a step runs it (:func:`_timed`). The fits minimise
the squared *relative* error, so that a tiny operator counts as much as a large one:

- :func:`fit_gemm`: ``op_overhead + 2mnk / (peak * gemm_max * d / (d + gemm_half_dim))``, ``d`` the
  GEMM's smallest dimension: for each ``gemm_half_dim`` on a fine grid, ``1 / gemm_max`` is a
  linear least-squares problem with a closed form, so the grid's best is the fit (no scipy);
- :func:`fit_link`: a collective's ``latency + bytes / bandwidth``, a weighted linear least squares;
- :func:`fit_efficiency`: attention's ``FLOPs / (peak * efficiency)``, closed form.

Collectives run in processes of their own (:func:`measure_collectives`), one thread each, over a
store on a port the OS chose.
"""

from __future__ import annotations

import functools
import json
import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from megatron_slapo.compat.torch_internals import TorchDispatchMode, flash_attention
from megatron_slapo.compat.torchao_float8 import torchao_float8
from megatron_slapo.kernels.fp8 import Fp8Recipe

SAMPLES = 5  # timed samples per measurement, of which the median counts
HELD_BYTES = 2**28  # results an elementwise measurement keeps alive at once (a step's activations)
OVERLAP_BYTES = 2**24  # the overlap's all-reduce: long beside the scheduler's time slices (ms)
STAGGER, STAGGER_DIM = 3, 256  # GEMMs of each rank's own before a timed collective, and their size
KEPT = 8  # results of a collective kept alive at once
CHAIN = 100  # operators in the chain that op_overhead times
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send")
_HOST, _RESULT = "127.0.0.1", "calibration_result"
# torch 2.13's names for the tensor forms (the older ones, deprecated there, before it)
_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_FUSED = ("flash", "efficient", "cudnn")  # SDPA kernels that keep only the logsumexp, not the scores


def seconds(fn: Callable[[], object], device: torch.device, budget: float) -> float:
    """The median time of one call of ``fn``, in seconds, over :data:`SAMPLES` samples that together
    last about ``budget`` seconds: each sample runs ``fn`` as many times as fit in its share (one at
    least), so that the clock's own cost vanishes beside a tiny operator."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()  # warm-up: lazy initialisation, kernel selection, caches
    sync()
    start = time.perf_counter()
    fn()
    sync()
    calls = max(1, int(budget / SAMPLES / max(time.perf_counter() - start, 1e-7)))
    samples = []
    for _ in range(SAMPLES):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def gemm_seconds(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, budget: float,
                 linear: bool) -> float:  # fmt: skip
    """One ``(m, k) @ (k, n)`` product, forward only: ``a @ b``, or ``F.linear(x, weight)`` with
    ``weight`` ``(n, k)`` as a transformer's layers call it."""
    a = torch.randn(m, k, dtype=dtype, device=device)
    if linear:
        weight = torch.randn(n, k, dtype=dtype, device=device)
        return seconds(lambda: F.linear(a, weight), device, budget)
    b = torch.randn(k, n, dtype=dtype, device=device)
    return seconds(lambda: a @ b, device, budget)


def fp8_gemm_seconds(n: int, device: torch.device, budget: float) -> float:
    """One ``n x n x n`` FP8 (e4m3) product as the trainer's FP8 layers run it: torchao's float8
    tensors multiplied (``torch._scaled_mm`` on a GPU, the weight column-major as ``weight.t()``
    gives it), cast once before the timing, so that only the GEMM is timed. Raises ImportError
    without torchao, RuntimeError where the device has no FP8 GEMM."""
    ao, mm_config = torchao_float8(), Fp8Recipe("tensorwise", "e4m3").mm_config
    scale = torch.ones((), device=device)

    def cast(t: torch.Tensor, role: Any) -> torch.Tensor:
        return ao.hp_tensor_and_scale_to_float8(t, scale, torch.float8_e4m3fn, mm_config, role)

    x = cast(torch.randn(n, n, dtype=torch.bfloat16, device=device), ao.GemmInputRole.INPUT)
    weight = cast(torch.randn(n, n, dtype=torch.bfloat16, device=device).t(), ao.GemmInputRole.WEIGHT)
    return seconds(lambda: torch.mm(x, weight), device, budget)


def op_overhead_seconds(device: torch.device, budget: float, grad: bool) -> float:
    """The fixed cost of one operator: a chain of :data:`CHAIN` multiplications of 64-element
    tensors, timed whole and divided by the operators run. With ``grad`` the chain starts from a
    tensor that requires grad and is run backward too, as the trainer runs it: ``CHAIN`` forward and
    ``CHAIN`` backward multiplications (and one accumulation into ``.grad``, left uncounted)."""
    x = torch.ones(64, device=device, requires_grad=grad)
    factor, seed = torch.full((64,), 1.0001, device=device), torch.ones(64, device=device)

    def chain() -> None:
        y = x
        for _ in range(CHAIN):
            y = y * factor
        if grad:
            y.backward(seed)

    with torch.set_grad_enabled(grad):
        return seconds(chain, device, budget) / (2 * CHAIN if grad else CHAIN)


ELEMENTWISE = {  # operator -> (call on x, tensors of x's size read and written)
    "add": (lambda x: x + x, 2), "mul": (lambda x: x * 1.5, 2), "copy": (lambda x: x.clone(), 2),
    "exp": (torch.exp, 2), "gelu": (F.gelu, 2), "tanh": (torch.tanh, 2),
    "softmax": (lambda x: torch.softmax(x.view(-1, 1024), dim=-1), 2),
    "layer_norm": (lambda x: F.layer_norm(x.view(-1, 1024), (1024,)), 2),
}  # fmt: skip


def elementwise_samples(sizes: tuple[int, ...], device: torch.device, budget: float) -> list[list]:
    """``[operator, elements, bytes, seconds]`` of each :data:`ELEMENTWISE` operator on fp32 tensors of
    each of ``sizes`` elements: what the time model's elementwise terms are fitted to. Each result
    is kept, as autograd keeps a step's activations, until :data:`HELD_BYTES` are held: on a CPU a
    result then lands in memory the allocator must fetch from the system (page faults), which costs
    more than the operator's arithmetic; reused at once, as a loop over one operator would, it is free."""
    rows = []
    for n in sizes:
        x, held = torch.randn(n, device=device), []
        for name, (op, tensors) in ELEMENTWISE.items():
            rows.append([name, n, tensors * 4 * n, seconds(functools.partial(_kept, op, x, held), device, budget)])
    return rows


def _kept(op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, held: list[torch.Tensor]) -> None:
    """``op(x)``, its result held with the others until they pass :data:`HELD_BYTES`."""
    held.append(op(x))
    if sum(t.numel() * t.element_size() for t in held) > HELD_BYTES:
        held.clear()


def fit_elementwise(rows: list[list], overhead: float) -> tuple[float, float]:
    """``(bytes/s, elements/s)`` of ``time = overhead + bytes / B + elements / R``, least squares on
    relative error (the two rates' inverses, neither below zero)."""
    a = np.array([[b / t, e / t] for _, e, b, t in rows])
    y = np.array([1 - overhead / t for *_, t in rows])
    inverse = np.clip(np.linalg.lstsq(a, y, rcond=None)[0], 1e-15, None)
    return 1 / inverse[0], 1 / inverse[1]


def add_gb_per_s(nbytes: int, device: torch.device, budget: float) -> float:
    """The bandwidth of ``torch.add(a, b, out=c)`` on fp32 tensors of ``nbytes`` each, counting three
    tensors' bytes moved (two read, one written)."""
    a, b, c = (torch.ones(nbytes // 4, device=device) for _ in range(3))
    return 3 * nbytes / seconds(lambda: torch.add(a, b, out=c), device, budget) / 1e9


def attention(shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device,
              budget: float) -> tuple[float, float]:  # fmt: skip
    """``(FLOPs, seconds)`` of causal SDPA forward and backward on ``(batch, heads, seq, head_dim)``
    inputs. The FLOPs are ``FlopCounterMode``'s over the call the time model's meta pass makes in its
    place, torch's flash kernel (:func:`~megatron_slapo.compat.torch_internals.flash_attention`;
    SDPA itself takes its math path on meta, and torch's CPU flash kernel has no FLOP formula)."""

    def run(attend: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        out = attend(q, k, v)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    with FlopCounterMode(display=False) as counter:
        meta = [torch.empty(shape, dtype=dtype, device="meta", requires_grad=True) for _ in range(3)]
        run(lambda q, k, v: flash_attention(q, k, v, 0.0, True, shape[-1] ** -0.5), *meta)
    sdpa = functools.partial(F.scaled_dot_product_attention, is_causal=True)
    qkv = [torch.randn(shape, dtype=dtype, device=device, requires_grad=True) for _ in range(3)]
    return float(counter.get_total_flops()), seconds(lambda: run(sdpa, *qkv), device, budget)


class _Operators(TorchDispatchMode):
    """Records the name of every ATen operator run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def attention_kernel(dtype: torch.dtype, device: torch.device) -> tuple[str, str]:
    """``("flash", operator)`` where SDPA dispatches to a fused kernel that keeps only the logsumexp
    (flash, memory-efficient or cuDNN), else ``("eager", operator)``: the scores are materialised."""
    q = torch.randn(1, 2, 64, 32, dtype=dtype, device=device)
    with _Operators() as seen:
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    fused = [name for name in seen.names if any(kind in name for kind in _FUSED)]
    return ("flash", fused[0]) if fused else ("eager", ", ".join(seen.names))


def fit_gemm(samples: list[tuple[float, int, float, str]], overhead: float) -> tuple[float, float, float]:
    """``(gemm_max, gemm_half_dim, rms relative error)`` fitted to ``(seconds at the peak, smallest
    dimension, measured seconds, dtype)`` samples, with ``overhead`` seconds fixed per call."""
    work, dim, measured = (np.array(column, dtype=float) for column in list(zip(*samples, strict=True))[:3])
    best = (np.inf, 1.0, 0.0)
    for half in np.concatenate([[0.0], np.geomspace(0.5, 16384, 2000)]):
        stretched = work * (dim + half) / dim / measured  # the compute term over the measured time, times gemm_max
        offset = (overhead - measured) / measured
        inverse = -np.dot(offset, stretched) / np.dot(stretched, stretched)  # 1 / gemm_max
        error = float(np.sum((offset + inverse * stretched) ** 2))
        if inverse > 0 and error < best[0]:
            best = (error, 1 / inverse, float(half))
    error, gemm_max, half = best
    return gemm_max, half, float(np.sqrt(error / len(measured)))


def monotone(points: list[list[float]]) -> list[list[float]]:
    """``[[x, y], ...]`` (ascending ``x``) with ``y`` made non-decreasing by least squares (pooling
    adjacent violators): a larger call takes no less time, and what says otherwise is noise (a
    small call's wait for a rank the scheduler held back)."""
    blocks: list[list[float]] = []  # [mean y, points pooled]
    for _, y in points:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (y1, n1), (y2, n2) = blocks.pop(), blocks.pop()
            blocks.append([(y1 * n1 + y2 * n2) / (n1 + n2), n1 + n2])
    ys = [y for y, n in blocks for _ in range(int(n))]
    return [[x, y] for (x, _), y in zip(points, ys, strict=True)]


def fit_link(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """``(latency_us, gb_per_s)`` of ``seconds = latency + bytes / bandwidth`` fitted to ``(bytes,
    seconds)`` samples; a latency the fit puts below zero is zero, the bandwidth refitted alone;
    times that do not grow with the bytes (noise over a few small sizes) give the bandwidth the
    largest call had at least, the latency refitted alone."""
    size, measured = (np.array(column, dtype=float) for column in zip(*samples, strict=True))
    rows = np.stack([1 / measured, size / measured], axis=1)
    (latency, inverse), *_ = np.linalg.lstsq(rows, np.ones_like(measured), rcond=None)
    if inverse <= 0:
        largest = int(np.argmax(size))
        inverse = measured[largest] / size[largest]
        latency = np.sum(rows[:, 0] * (1 - inverse * rows[:, 1])) / np.sum(rows[:, 0] ** 2)
    if latency < 0:
        latency, inverse = 0.0, np.sum(rows[:, 1]) / np.sum(rows[:, 1] ** 2)
    return float(latency * 1e6), float(1 / inverse / 1e9)


def fit_efficiency(samples: list[tuple[float, float]], peak_flops: float) -> float:
    """The share of ``peak_flops`` that ``seconds = FLOPs / (peak * efficiency)`` fits best to
    ``(FLOPs, seconds)`` samples."""
    rate = np.array([flops / measured for flops, measured in samples]) / peak_flops
    return float(np.dot(rate, rate) / np.sum(rate))


def _timed(fn: Callable[[], object], device: torch.device, repeats: int, staggered: bool = True) -> list[float]:
    """Seconds of each of ``repeats`` calls of a collective, after one warm-up call and a barrier.
    ``staggered``: as a training step pays them, each call after a little compute of every rank's own
    (:data:`STAGGER` GEMMs), so that the ranks arrive apart, as between a step's layers, and the
    wait for the last one is part of the time (without it, every call starts together)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    work = torch.randn(STAGGER_DIM, STAGGER_DIM, device=device)
    fn()
    out = []
    for _ in range(repeats):
        if not staggered or not out:
            dist.barrier()
        for _ in range(STAGGER if staggered else 0):
            work @ work
        sync()
        start = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - start)
    return out


def _collective_calls(nbytes: int, world: int, rank: int, device: torch.device) -> dict[str, Callable[[], object]]:
    """Each collective of :data:`COLLECTIVES` on a payload of ``nbytes`` as ``--log-comm`` counts it:
    the tensor (all-reduce, broadcast, send), the gathered output (all-gather), the input
    (reduce-scatter, all-to-all). ``send``: every even rank sends to the next odd one at once. As in
    a step, a result is a new tensor, kept alive with the last :data:`KEPT` (on a CPU, memory the
    allocator must fault in); an all-reduce and a broadcast work in place, as on a layer's output."""
    count = max(nbytes // 4 // world, 1) * world
    whole, part = torch.zeros(count, device=device), torch.zeros(count // world, device=device)
    kept: list[torch.Tensor] = []
    peer = rank ^ 1

    def fresh(n: int) -> torch.Tensor:
        kept.append(torch.empty(n, device=device))
        del kept[:-KEPT]
        return kept[-1]

    def send() -> None:
        if peer < world:
            dist.send(whole, peer) if rank % 2 == 0 else dist.recv(fresh(count), peer)

    return {"all_reduce": lambda: dist.all_reduce(whole), "all_gather": lambda: _ALL_GATHER(fresh(count), part),
            "reduce_scatter": lambda: _REDUCE_SCATTER(fresh(count // world), whole),
            "all_to_all": lambda: dist.all_to_all_single(fresh(count), whole),
            "broadcast": lambda: dist.broadcast(whole, 0), "send": send}  # fmt: skip


def _overlap_samples(device: torch.device, repeats: int) -> dict[str, list[float]]:
    """Seconds of an all-reduce of :data:`OVERLAP_BYTES` alone, of GEMMs that take about as long
    alone, and of the all-reduce started asynchronously while the same GEMMs run (then awaited); the
    three taken in turn, repeat after repeat, so that a load from elsewhere weighs on each alike."""
    payload, a = torch.zeros(OVERLAP_BYTES // 4, device=device), torch.randn(256, 256, device=device)
    reduce_alone = statistics.median(_timed(lambda: dist.all_reduce(payload), device, repeats, False))
    count = torch.tensor(
        [max(1, round(reduce_alone / min(_timed(lambda: a @ a, device, repeats, False))))], device=device
    )
    dist.all_reduce(count, op=dist.ReduceOp.MAX)  # the same GEMMs on every rank

    def gemms() -> None:
        for _ in range(int(count.item())):
            a @ a

    def both() -> None:
        work = dist.all_reduce(payload, async_op=True)
        gemms()
        work.wait()

    calls = {"all_reduce": lambda: dist.all_reduce(payload), "gemms": gemms, "both": both}
    out: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            out[name] += _timed(call, device, 1, False)
    return out


def _collective_worker(rank: int, world: int, port: int, backend: str, sizes: list[int], repeats: int,
                       overlap: bool) -> None:  # fmt: skip
    """One rank of :func:`measure_collectives`: times every collective at every size, and rank 0
    leaves in the store, as JSON, what a step pays for each: the mean over repeats and ranks (a
    step sums its collectives, the slow ones with the rest; each rank's time includes its wait for
    the others); and for the overlap's samples, each repeat's slowest rank's median."""
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore(_HOST, port, is_master=False, timeout=timedelta(minutes=5))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    try:
        samples: dict[str, list[float]] = {}
        for nbytes in sizes:
            for name, call in _collective_calls(nbytes, world, rank, device).items():
                samples[f"{name} {nbytes}"] = _timed(call, device, repeats)
        if overlap:
            samples.update({f"overlap {k}": v for k, v in _overlap_samples(device, repeats).items()})
        times = torch.tensor([t for v in samples.values() for t in v], dtype=torch.float64, device=device)
        slowest = times.clone()
        dist.all_reduce(times)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        rows = zip(
            samples,
            (times / world).view(len(samples), -1).tolist(),
            slowest.view(len(samples), -1).tolist(),
            strict=True,
        )
        result = {name: statistics.median(worst) if name.startswith("overlap") else statistics.mean(mean)
                   for name, mean, worst in rows}  # fmt: skip
        if rank == 0:
            store.set(_RESULT, json.dumps(result))
    finally:
        dist.destroy_process_group()


def measure_collectives(world: int, backend: str, sizes: list[int], repeats: int,
                        overlap: bool = False) -> dict[str, object]:  # fmt: skip
    """Spawn ``world`` ranks on this machine and time each of :data:`COLLECTIVES` on payloads of
    ``sizes`` bytes, as a step pays them (:func:`_timed`, staggered):
    ``{collective: [[bytes, seconds], ...]}``, and with ``overlap`` (gloo) the share
    of an all-reduce that hides under GEMMs, ``(alone + alone - together) / the shorter``, in [0, 1],
    under ``"overlap"`` with its medians under ``"overlap_seconds"``."""
    store = dist.TCPStore(_HOST, 0, is_master=True, wait_for_workers=False)  # port 0: the OS picks a free one
    mp.spawn(_collective_worker, args=(world, store.port, backend, sizes, repeats, overlap), nprocs=world)
    result = json.loads(store.get(_RESULT))
    out: dict[str, object] = {name: [[n, result[f"{name} {n}"]] for n in sizes] for name in COLLECTIVES}
    if overlap:
        alone = {k: result[f"overlap {k}"] for k in ("all_reduce", "gemms", "both")}
        hidden = (alone["all_reduce"] + alone["gemms"] - alone["both"]) / min(alone["all_reduce"], alone["gemms"])
        out["overlap"], out["overlap_seconds"] = min(max(hidden, 0.0), 1.0), alone
    return out
