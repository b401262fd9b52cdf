"""Hardware profiles: what a device and its links can do, for the time model (``--hardware``).

A profile is a JSON file: the built-in ones in ``estimates/profiles/`` (``a100-sxm-80g``,
``h100-sxm``, ``h200-sxm``, ``b200``: datasheet numbers, each with its source in the file), or one
that ``tools/calibrate.py`` measured on the machine it ran on. Its fields:

- ``peak_tflops``: dense peak per device by compute dtype (``bf16``, ``fp8``, ``fp32``; a dtype the
  device has no tensor cores for is ``null``);
- ``memory_gib``: the device's memory; ``memory_gb_per_s``: its bandwidth (HBM, or DRAM on a CPU);
- ``scale_up`` and ``scale_out``: the link between the devices of a node (NVLink) and the one each
  device has to other nodes (InfiniBand/RoCE), each ``gb_per_s`` one way and ``latency_us``;
- ``efficiency``: what a kernel reaches of those peaks (fitted, with what they were fitted to in
  ``fitted``): ``gemm_max`` of the peak for a large GEMM, falling as ``d / (d + gemm_half_dim)``
  with ``d`` the GEMM's smallest dimension; ``attention`` of the peak for fused attention;
  ``memory`` of the bandwidth for elementwise work; ``link`` of a link's bandwidth for a collective;
- ``op_overhead_us``: fixed time per operator (kernel launch and dispatch);
- ``communication_overlap``: how much of an overlappable collective (data-parallel gradient
  reduction, FSDP's gathers) hides under compute: 1 where communication has engines of its own
  (a GPU's copy engines and NCCL's SMs), 0 where it runs on the cores the compute uses (gloo);
- ``compute_units``: devices per node that compute at once (a CPU's cores: ranks beyond them share
  them), ``null`` for GPUs, where each rank owns its device;
- ``attention_kernel``: the attention kernel the device runs (``flash``: only q, k, v, the output
  and the logsumexp are kept, as explain then counts);
- ``elementwise_gelem_per_s`` (optional, from calibration): elements per second an elementwise
  operator spends arithmetic on beyond its bytes (a CPU's exp or tanh), none on a GPU;
- ``collectives`` (optional, from calibration): fitted ``[latency_us, gb_per_s]`` per collective
  and group size, used in place of the link's formula where present;
- ``collective_seconds`` (optional, from calibration): the measured ``[[bytes, seconds], ...]`` of
  one call per collective and group size, which the time model interpolates, in place of both (on
  a CPU a call's time is no line in its size: new memory beyond some size is page faults).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_slapo.errors import ConfigError

PROFILES = Path(__file__).with_name("profiles")
GPUS_PER_NODE = 8  # a GPU profile's node unless told otherwise: a DGX/HGX
REQUIRED = {
    "name": str, "peak_tflops": dict, "memory_gib": (int, float), "memory_gb_per_s": (int, float),
    "scale_up": dict, "scale_out": dict, "efficiency": dict, "op_overhead_us": (int, float),
    "communication_overlap": (int, float), "attention_kernel": str,
}  # fmt: skip
LINK = ("gb_per_s", "latency_us")
EFFICIENCY = ("gemm_max", "gemm_half_dim", "attention", "memory", "link")


@dataclass(frozen=True)
class Link:
    """One kind of link: bandwidth one way per device (GB/s) and the latency of a message (us)."""

    gb_per_s: float
    latency_us: float
    name: str = ""


@dataclass(frozen=True)
class Hardware:
    """A device and its links (see the module docstring for each field's meaning)."""

    name: str
    peak_tflops: dict[str, float | None]
    memory_gib: float
    memory_gb_per_s: float
    scale_up: Link
    scale_out: Link
    efficiency: dict[str, float]
    op_overhead_us: float
    communication_overlap: float
    attention_kernel: str
    compute_units: int | None = None
    collectives: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    collective_seconds: dict[str, dict[str, list[list[float]]]] = field(default_factory=dict)
    elementwise_gelem_per_s: float | None = None
    source: str = ""  # the file it came from

    def peak(self, dtype: str) -> float:
        """Dense peak TFLOP/s in ``dtype`` (``bf16``, ``fp8``, ``fp32``); FP8 on a device without it
        runs at the bf16 peak (the run would be refused there; the model does not guess better)."""
        value = self.peak_tflops.get(dtype) or (self.peak_tflops.get("bf16") if dtype == "fp8" else None)
        if not value:
            raise ConfigError(f"hardware profile {self.name} has no peak_tflops.{dtype}")
        return float(value)


def builtin_names() -> list[str]:
    return sorted(p.stem for p in PROFILES.glob("*.json"))


def _check(data: dict[str, Any], where: str) -> None:
    """One ConfigError naming the first missing or mistyped field."""
    for key, kind in REQUIRED.items():
        if key not in data:
            raise ConfigError(f"hardware profile {where} is missing the field {key}")
        if not isinstance(data[key], kind):
            raise ConfigError(f"hardware profile {where}: field {key} has the wrong type ({type(data[key]).__name__})")
    for link in ("scale_up", "scale_out"):
        for key in LINK:
            if not isinstance(data[link].get(key), (int, float)):
                raise ConfigError(f"hardware profile {where} is missing the field {link}.{key}")
    for key in EFFICIENCY:
        if not isinstance(data["efficiency"].get(key), (int, float)):
            raise ConfigError(f"hardware profile {where} is missing the field efficiency.{key}")
    if not isinstance(data["peak_tflops"].get("bf16"), (int, float)) and not isinstance(
        data["peak_tflops"].get("fp32"), (int, float)
    ):
        raise ConfigError(f"hardware profile {where} is missing the field peak_tflops.bf16")


def load(name_or_path: str) -> Hardware:
    """The built-in profile ``name_or_path``, else the JSON file at that path; one ConfigError
    naming the problem (unknown name, unreadable file, missing field)."""
    path = PROFILES / f"{name_or_path}.json"
    if not path.is_file():
        path = Path(name_or_path)
        if path.suffix != ".json" or not path.is_file():
            raise ConfigError(f"--hardware {name_or_path}: no such profile (built in: {', '.join(builtin_names())}) "
                              "and no such .json file")  # fmt: skip
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--hardware {name_or_path}: cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--hardware {name_or_path}: {path} is not a JSON object")
    _check(data, str(path) if path.parent != PROFILES else name_or_path)

    def link(d: dict[str, Any]) -> Link:
        return Link(float(d["gb_per_s"]), float(d["latency_us"]), d.get("name", ""))

    return Hardware(
        name=data["name"], peak_tflops=data["peak_tflops"], memory_gib=float(data["memory_gib"]),
        memory_gb_per_s=float(data["memory_gb_per_s"]), scale_up=link(data["scale_up"]),
        scale_out=link(data["scale_out"]), efficiency={k: float(v) for k, v in data["efficiency"].items()},
        op_overhead_us=float(data["op_overhead_us"]), communication_overlap=float(data["communication_overlap"]),
        attention_kernel=data["attention_kernel"], compute_units=data.get("compute_units"),
        collectives=data.get("collectives", {}), collective_seconds=data.get("collective_seconds", {}),
        elementwise_gelem_per_s=data.get("elementwise_gelem_per_s"), source=str(path),
    )  # fmt: skip
