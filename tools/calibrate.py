"""Measure this machine and write its hardware profile, for the time model (``--hardware PATH``).

    .venv/bin/python tools/calibrate.py                                   # calibration.json
    .venv/bin/python tools/calibrate.py --quick --ranks 2 --out /tmp/c.json  # a few shapes: ~30 s

Measures the current CUDA device if there is one, else the CPU, and writes the JSON that
:func:`megatron_slapo.estimates.hardware.load` reads (how each number is timed and fitted:
:mod:`megatron_slapo.estimates.calibration`):

- ``peak_tflops``: the best throughput of forward GEMMs (``a @ b``, and ``F.linear`` on a
  transformer layer's shapes) from 16 wide to 2048 (CPU) or 8192 (GPU), in fp32 and bf16; fp8
  through torchao's float8 tensors (``torch._scaled_mm``) on a GPU of compute capability 8.9 or
  more (else ``null``); ``efficiency.gemm_max`` and ``gemm_half_dim`` fitted to every GEMM's time;
- ``op_overhead_us``: one operator's fixed cost as training pays it (a chain of tiny operators
  on tensors that require grad, forward and backward, per operator run); without autograd it is
  ``op_overhead_nograd_us``, the fixed cost the GEMM fit assumes;
- ``memory_gb_per_s``: ``torch.add`` on 64 MiB tensors (512 MiB on a GPU), counting three tensors'
  bytes, and ``cache_gb_per_s`` on tensors that stay in the cache (a third of a MiB each; 8 MiB
  on a GPU);
- ``efficiency.memory`` and ``elementwise_gelem_per_s``: fitted to elementwise operators (add, exp,
  gelu, softmax, layer norm, ...) on tensors of :data:`ELEMENTWISE_SIZES`: the share of
  ``memory_gb_per_s`` their bytes move at, and the elements per second their arithmetic costs
  beyond that (on a CPU, exp or erf per element outlasts its bytes);
- ``efficiency.attention``: causal SDPA forward and backward, FLOPs as the time model's
  ``FlopCounterMode`` counts them, over the fp32 peak (CPU) or the bf16 peak (GPU);
- ``collective_seconds``: the seconds of one call of all-reduce, all-gather, reduce-scatter,
  all-to-all, broadcast and send at each ``--ranks`` size, over payloads of 1 KiB to 16 MiB as
  ``--log-comm`` counts them, from ranks this tool spawns (gloo on a CPU, NCCL over one GPU per
  rank; a size with too few GPUs is skipped), as a step pays them: the mean call, each after a few
  GEMMs of every rank's own and with a new result (the wait for the last rank, the page faults);
  ``collectives``: ``[latency_us, gb_per_s]`` fitted to them. ``scale_up`` (and ``scale_out``: one
  machine has no other link) is the link a ring all-reduce of the smallest size implies;
  ``efficiency.link`` is 1;
- ``communication_overlap``: with gloo, the measured share of an asynchronous all-reduce hidden
  under GEMMs on every rank; 1 on a GPU (NCCL runs on SMs and copy engines of its own).

On a CPU every measurement runs one thread (``torch.set_num_threads(1)``), as each rank of a
multi-process run does (torchrun sets ``OMP_NUM_THREADS=1``); ``compute_units`` is the cores this
process may use, which ranks beyond them share. The raw times are kept under ``measurements``.

- ``--out PATH``: the profile (default ``calibration.json``), checked writable before measuring.
- ``--ranks 2,4``: the group sizes of the collectives (default ``2,4``; with ``--quick``, ``2``).
- ``--quick``: a few shapes and sizes only (a test's run), fits included.
- ``--name NAME``: the profile's name (default ``calibrated-<host>-<device>``).
"""

from __future__ import annotations

if __name__ == "__main__":  # a Python without torch re-runs this with the repo's .venv (tools/repo_python.py)
    import repo_python  # noqa: F401

import datetime
import json
import os
import re
import shlex
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from megatron_slapo.arguments.output_paths import check_output_file  # noqa: E402
from megatron_slapo.arguments.parser import OneLineParser  # noqa: E402
from megatron_slapo.errors import ConfigError  # noqa: E402
from megatron_slapo.estimates import calibration as cal  # noqa: E402
from megatron_slapo.estimates import hardware  # noqa: E402
from megatron_slapo.training import error_report  # noqa: E402

Shape = tuple[int, ...]
MIB = 2**20


@dataclass(frozen=True)
class Grid:
    """What one run measures: GEMM shapes ``(m, n, k)`` for ``a @ b`` and for ``F.linear``, FP8
    square sizes, attention ``(batch, heads, seq, head_dim)``, the bytes of each tensor of the memory
    and of the cache bandwidth (three of them together stay in the cache), collective payloads,
    timed repeats per collective and seconds per compute measurement."""

    gemm: tuple[Shape, ...]
    linear: tuple[Shape, ...]
    fp8: tuple[int, ...]
    attention: tuple[Shape, ...]
    memory_bytes: int
    cache_bytes: int
    collective_bytes: tuple[int, ...]
    repeats: int
    budget: float


def _squares(top: int) -> tuple[Shape, ...]:
    return tuple((n, n, n) for n in (2**i for i in range(4, top.bit_length())))


def _layer(tokens: int, hidden: int) -> tuple[Shape, ...]:
    """A transformer layer's GEMMs, ``(m, n, k)``: query-key-value, attention out, MLP up and down."""
    up, down = (tokens, 4 * hidden, hidden), (tokens, hidden, 4 * hidden)
    return (tokens, 3 * hidden, hidden), (tokens, hidden, hidden), up, down


_PAYLOADS = tuple(2**10 * 4**i for i in range(8))  # 1 KiB to 16 MiB
GRIDS = {  # (device type, quick) -> Grid
    ("cpu", False): Grid(_squares(2048) + ((16, 1024, 1024), (1024, 1024, 64), (128, 2048, 1024)),
                         _layer(512, 512) + _layer(2048, 1024), (), ((1, 4, 128, 64), (1, 8, 256, 64),
                         (1, 8, 512, 64), (2, 8, 1024, 64)), 64 * MIB, MIB // 3, _PAYLOADS, 20, 0.25),
    ("cpu", True): Grid(((16, 16, 16), (64, 64, 64), (256, 256, 256), (512, 512, 512), (16, 512, 512)),
                        _layer(256, 256)[2:], (), ((1, 4, 128, 64), (1, 4, 256, 64)), 64 * MIB, MIB // 3,
                        (2**10, 2**16, 2**20), 5, 0.04),
    ("cuda", False): Grid(_squares(8192) + ((16, 8192, 8192), (128, 8192, 8192), (8192, 8192, 128)),
                          _layer(8192, 4096), (4096, 8192), ((8, 16, 512, 128), (4, 16, 2048, 128),
                          (2, 16, 4096, 128), (1, 16, 8192, 128)), 512 * MIB, 8 * MIB, _PAYLOADS, 9, 0.2),
    ("cuda", True): Grid(((16, 16, 16), (256, 256, 256), (1024, 1024, 1024), (4096, 4096, 4096), (16, 4096, 4096)),
                         _layer(4096, 4096)[2:3], (4096,), ((4, 16, 1024, 128), (2, 16, 2048, 128)), 256 * MIB, 8 * MIB,
                         (2**10, 2**16, 2**20), 5, 0.05),
}  # fmt: skip
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ELEMENTWISE_SIZES = (2**18, 2**21)  # fp32 elements: 1 MiB (in the cache) and 8 MiB


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name (``/proc/cpuinfo``), else ``cpu``."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "cpu"
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "cpu")


def _links_fallback(name: str) -> tuple[str, dict[str, Any]]:
    """Where no collective could be measured (one GPU): the built-in profile whose device this is
    (its name's first word, e.g. ``h200``, in the device's name), else ``h100-sxm``, and its links."""
    match = [p for p in hardware.builtin_names() if p.split("-")[0] in name.lower()]
    builtin = match[0] if match else "h100-sxm"
    data = json.loads((hardware.PROFILES / f"{builtin}.json").read_text())
    return builtin, {"scale_up": data["scale_up"], "scale_out": data["scale_out"]}


def measure_compute(device: torch.device, grid: Grid, say: Callable[[str], None]) -> dict[str, Any]:
    """Every compute measurement of ``grid``: ``{gemm, linear: {dtype: [[m, n, k, s]]}, fp8: [[n, s]],
    attention: [[b, h, s, d, FLOPs, s]], op_overhead_s, op_overhead_nograd_s, memory: [[bytes, GB/s]],
    cache: [[bytes, GB/s]], attention_kernel: [kind, operator], fp8_error}``."""
    out: dict[str, Any] = {"fp8": [], "fp8_error": None}
    for kind, shapes in (("gemm", grid.gemm), ("linear", grid.linear)):
        say(f"{len(shapes)} GEMMs ({'F.linear' if kind == 'linear' else 'a @ b'}) in fp32 and bf16")
        out[kind] = {name: [[*s, cal.gemm_seconds(*s, dtype, device, grid.budget, kind == "linear")] for s in shapes]
                     for name, dtype in DTYPES.items()}  # fmt: skip
    if grid.fp8 and torch.cuda.get_device_capability(device) >= (8, 9):
        say("FP8 GEMMs (torchao float8, torch._scaled_mm)")
        try:
            out["fp8"] = [[n, cal.fp8_gemm_seconds(n, device, grid.budget)] for n in grid.fp8]
        except (ImportError, RuntimeError) as e:
            out["fp8_error"] = f"not measured: the FP8 GEMM failed: {str(e).splitlines()[0]}"
    elif device.type == "cpu":
        out["fp8_error"] = "not measured: no FP8 GEMM on a CPU"
    else:
        major, minor = torch.cuda.get_device_capability(device)
        out["fp8_error"] = f"not measured: compute capability {major}.{minor}, FP8 GEMMs need 8.9"
    say("operator overhead, memory bandwidth")
    out["op_overhead_s"] = cal.op_overhead_seconds(device, grid.budget, grad=True)
    out["op_overhead_nograd_s"] = cal.op_overhead_seconds(device, grid.budget, grad=False)
    out["memory"] = [[grid.memory_bytes, cal.add_gb_per_s(grid.memory_bytes, device, grid.budget)]]
    out["cache"] = [[grid.cache_bytes, cal.add_gb_per_s(grid.cache_bytes, device, grid.budget)]]
    out["elementwise"] = cal.elementwise_samples(ELEMENTWISE_SIZES, device, grid.budget)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    say(f"{len(grid.attention)} attention shapes")
    out["attention"] = [[*s, *cal.attention(s, dtype, device, grid.budget)] for s in grid.attention]
    out["attention_kernel"] = list(cal.attention_kernel(dtype, device))
    return out


def measure_links(device: torch.device, grid: Grid, ranks: list[int],
                  say: Callable[[str], None]) -> tuple[dict[str, Any], list[str]]:  # fmt: skip
    """The collectives at each group size in ``ranks`` that this machine has devices for:
    ``{"2": {collective: [[bytes, s]], "overlap": ...}}``, and a note for each size skipped."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    out, notes = {}, []
    for world in ranks:
        if device.type == "cuda" and torch.cuda.device_count() < world:
            notes.append(f"{world} ranks skipped: {torch.cuda.device_count()} GPU(s) here")
            continue
        say(f"collectives over {world} ranks ({backend})")
        overlap = backend == "gloo" and world == min(ranks)
        try:
            out[str(world)] = cal.measure_collectives(world, backend, list(grid.collective_bytes), grid.repeats,
                                                      overlap)  # fmt: skip
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:  # left out, with a note
            notes.append(f"{world} ranks failed: {str(e).strip().splitlines()[-1]}")
    return out, notes


def build_profile(device: torch.device, name: str, compute: dict[str, Any], links: dict[str, Any],
                  notes: list[str], stamp: str) -> dict[str, Any]:  # fmt: skip
    """The profile's JSON (see :mod:`megatron_slapo.estimates.hardware`), from the measurements."""
    gemms = {d: compute["gemm"][d] + compute["linear"][d] for d in DTYPES}
    peak = {d: max(2 * m * n * k / s for m, n, k, s in rows) for d, rows in gemms.items()}
    fp8 = max((2 * n**3 / s for n, s in compute["fp8"]), default=None)
    overhead = compute["op_overhead_nograd_s"]
    samples = [(2 * m * n * k / peak[d], min(m, n, k), s, d) for d, rows in gemms.items() for m, n, k, s in rows]
    gemm_max, half_dim, gemm_error = cal.fit_gemm(samples, overhead)
    by_dtype = {}
    for d in DTYPES:
        fit = cal.fit_gemm([row for row in samples if row[3] == d], overhead)
        by_dtype[d] = dict(zip(("gemm_max", "gemm_half_dim", "rms_error"), (round(x, 4) for x in fit), strict=True))
    bytes_per_s, elements_per_s = cal.fit_elementwise(compute["elementwise"], overhead)
    attn_dtype = "fp32" if device.type == "cpu" else "bf16"
    attention = cal.fit_efficiency([(f, s) for *_, f, s in compute["attention"]], peak[attn_dtype])
    collectives = {op: {w: [round(x, 3) for x in cal.fit_link(got[op])] for w, got in links.items()}
                   for op in cal.COLLECTIVES}  # fmt: skip
    cpu = device.type == "cpu"
    if links:
        world = min(links, key=int)
        steps, (latency, gb_per_s) = 2 * (int(world) - 1), collectives["all_reduce"][world]
        link = {"name": f"measured: {world}-rank {'gloo' if cpu else 'NCCL'} all-reduce, ring model",
                "gb_per_s": round(gb_per_s * steps / int(world), 3),
                "latency_us": round(latency / steps, 3)}  # fmt: skip
        scale = {"scale_up": link, "scale_out": dict(link)}
        link_source = (
            f"{stamp}: the {world}-rank all_reduce fit read as a ring (each rank moves 2(n-1)/n of "
            "the payload in 2(n-1) steps); one machine has no scale-out link, so scale_out is the same"
        )
    else:
        builtin, scale = _links_fallback(device_name(device))
        link_source = f"not measured ({'; '.join(notes)}): copied from the built-in profile {builtin}"
    overlap = 1.0  # a GPU: NCCL runs beside the compute
    if cpu:  # gloo: as measured at the smallest size, else none (it runs on the cores the compute uses)
        overlap = links[min(links, key=int)].get("overlap", 0.0) if links else 0.0
    kernel, kernel_op = compute["attention_kernel"]
    return {
        "name": name,
        "description": f"{name}: measured on {device_name(device)}" + (", one thread per rank" if cpu else ""),
        "peak_tflops": {"bf16": round(peak["bf16"] / 1e12, 4), "fp8": fp8 and round(fp8 / 1e12, 4),
                        "fp32": round(peak["fp32"] / 1e12, 4)},
        "memory_gib": round((os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if cpu
                             else torch.cuda.get_device_properties(device).total_memory) / 2**30, 2),
        "memory_gb_per_s": round(compute["memory"][0][1], 3), "cache_gb_per_s": round(compute["cache"][0][1], 3),
        **scale,
        "efficiency": {"gemm_max": round(gemm_max, 4), "gemm_half_dim": round(half_dim, 2),
                       "attention": round(attention, 4),
                       "memory": round(bytes_per_s / 1e9 / compute["memory"][0][1], 4), "link": 1.0},
        "elementwise_gelem_per_s": round(elements_per_s / 1e9, 4),
        "gemm_by_dtype": by_dtype,
        "op_overhead_us": round(compute["op_overhead_s"] * 1e6, 3),
        "op_overhead_nograd_us": round(overhead * 1e6, 3),
        "communication_overlap": round(overlap, 3),
        "compute_units": len(os.sched_getaffinity(0)) if cpu else None,
        "attention_kernel": kernel,
        "collectives": collectives if links else {},
        "collective_seconds": {op: {w: cal.monotone(got[op]) for w, got in links.items()} for op in cal.COLLECTIVES}
        if links else {},
        "sources": {
            "peak_tflops": f"{stamp}: the best forward GEMM throughput per dtype; fp8: "
                           + (compute["fp8_error"] or "torchao's float8 tensors (torch._scaled_mm), e4m3"),
            "memory_gib": f"{stamp}: {'physical RAM' if cpu else 'the GPU memory'}",
            "memory_gb_per_s": f"{stamp}: torch.add(a, b, out=c), three {compute['memory'][0][0] // MIB} MiB tensors",
            "cache_gb_per_s": f"{stamp}: torch.add(a, b, out=c), three {compute['cache'][0][0]}-byte tensors",
            "scale_up": link_source, "scale_out": link_source,
            "op_overhead_us": f"{stamp}: {cal.CHAIN} multiplications of 64-element tensors requiring grad, "
                              "forward and backward, per operator run",
            "attention_kernel": f"{stamp}: SDPA dispatches to aten.{kernel_op}",
            "collectives": f"{stamp}: " + ("; ".join(notes) or "every --ranks size measured"),
            "collective_seconds": f"{stamp}: the measurements the collectives' fits are fitted to, made "
                                  "non-decreasing in the size (least squares)",
            "communication_overlap": f"{stamp}: " + (f"an asynchronous {cal.OVERLAP_BYTES // MIB} MiB all-reduce "
                                                     "under as long GEMMs on every rank (overlap_seconds)" if cpu
                                                     else "not measured: NCCL runs beside a GPU's compute"),
        },
        "fitted": {
            "efficiency.gemm_max": f"{sum(map(len, gemms.values()))} forward GEMMs, fp32 and bf16 each over its own "
                                   f"peak, op_overhead_nograd_us fixed per call: rms relative error {gemm_error:.1%}",
            "efficiency.gemm_half_dim": "the same fit (least squares on relative error, grid over gemm_half_dim)",
            "gemm_by_dtype": "the same fit to each dtype's GEMMs alone (not read by the time model)",
            "efficiency.attention": f"causal SDPA forward and backward over the {attn_dtype} peak, FLOPs as "
                                    "FlopCounterMode counts torch's flash kernel on the meta device, as the time model "
                                    "does (4bhs^2d forward, 10bhs^2d backward: full, not causal-halved, scores), least "
                                    "squares on relative error",
            "efficiency.memory": f"with elementwise_gelem_per_s: op_overhead_nograd_us + bytes / (memory_gb_per_s x "
                                 f"memory) + elements / elementwise_gelem_per_s, least squares on relative error over "
                                 f"{', '.join(cal.ELEMENTWISE)} on fp32 tensors of {' and '.join(map(str, ELEMENTWISE_SIZES))} "
                                 "elements (the cache's sizes of a small model's activations, and beyond)",
            "elementwise_gelem_per_s": "the same fit: what a CPU's elementwise operators spend per element "
                                       "beyond their bytes (exp, tanh, erf: arithmetic, not memory)",
            "efficiency.link": "1: the collectives' fits are already what they reach",
            "collectives": "latency_us + bytes / gb_per_s, least squares on relative error, over each payload's "
                           "mean time per call over repeats and ranks, each call after a few GEMMs of every "
                           "rank's own, with a new result (as a training step pays it: waits and page faults)",
        },
        "measurements": {**compute, "collectives": links},
    }  # fmt: skip


def _compact(data: dict[str, Any]) -> str:
    """``data`` as indented JSON, with each innermost list of numbers on one line."""
    text = json.dumps(data, indent=1)
    return re.sub(r"\[[^\[\]{}\"]*\]", lambda m: "[" + " ".join(m.group(0)[1:-1].split()) + "]", text)


def summary(profile: dict[str, Any], path: str, took: float) -> str:
    """The profile's numbers as a short table, for the terminal and the log."""
    p, e = profile["peak_tflops"], profile["efficiency"]
    alone = "  ".join(f"{d} alone {f['gemm_max']}, {f['gemm_half_dim']}" for d, f in profile["gemm_by_dtype"].items())
    lines = [f"Profile {profile['name']} -> {path} ({took:.0f} s)",
             f"  peak TFLOP/s      fp32 {p['fp32']}  bf16 {p['bf16']}  fp8 {p['fp8']}",
             f"  GEMM fit          gemm_max {e['gemm_max']}  gemm_half_dim {e['gemm_half_dim']}  ({alone})",
             f"  op overhead       {profile['op_overhead_us']} us with autograd, "
             f"{profile['op_overhead_nograd_us']} us without",
             f"  memory            {profile['memory_gb_per_s']} GB/s (cache {profile['cache_gb_per_s']} GB/s), "
             f"{profile['memory_gib']} GiB",
             f"  attention         {e['attention']} of the peak ({profile['attention_kernel']} kernel)",
             f"  scale_up          {profile['scale_up']['gb_per_s']} GB/s, {profile['scale_up']['latency_us']} us",
             f"  overlap           {profile['communication_overlap']}",
             f"  {'collective':<16}{'ranks':>6}{'latency_us':>12}{'GB/s':>10}"]  # fmt: skip
    for op, fits in profile["collectives"].items():
        lines += [f"  {op:<16}{world:>6}{latency:>12}{gb:>10}" for world, (latency, gb) in fits.items()]
    return "\n".join(lines)


def _ranks(text: str) -> list[int]:
    try:
        ranks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--ranks {text}: give group sizes like 2,4") from None
    if not ranks or ranks[0] < 2:
        raise ConfigError(f"--ranks {text}: give group sizes of 2 ranks or more, like 2,4")
    return ranks


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = OneLineParser(prog="calibrate.py", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="calibration.json")
    parser.add_argument("--ranks")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--name")
    with error_report.user_errors("calibrate.py"):
        args = parser.parse_args(argv)
        ranks = _ranks(args.ranks or ("2" if args.quick else "2,4"))
        check_output_file("--out", args.out)
    start = time.perf_counter()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # one rank's share, as torchrun gives each of several
    host, machine = socket.gethostname(), device_name(device)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = shlex.join(["tools/calibrate.py", *argv])
    print(f"{command}  # {date}, {host}: {machine}, {len(os.sched_getaffinity(0))} cores, torch {torch.__version__}")
    stamp = f"measured by tools/calibrate.py on {date}, {machine}, torch {torch.__version__}, {command}"

    def say(what: str) -> None:
        print(f"> {time.perf_counter() - start:5.1f} s: {what}", flush=True)

    grid = GRIDS[device.type, args.quick]
    compute = measure_compute(device, grid, say)
    links, notes = measure_links(device, grid, ranks, say)
    name = args.name or f"calibrated-{_slug(host)}-{_slug(machine)}"
    profile = build_profile(device, name, compute, links, notes, stamp)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    Path(args.out).write_text(_compact(profile) + "\n")
    print(summary(profile, args.out, time.perf_counter() - start))
    for note in notes:
        print(f"  note: {note}")


if __name__ == "__main__":
    main()
