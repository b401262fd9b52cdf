"""A deep run's estimates from two shallow plans of it, for the tuner's ``--predict-only``.

Every per-rank figure explain measures grows by the same amount with each layer a pipeline stage
holds, when the layers are alike: a stage's weights, gradients, optimizer state, saved
activations, collectives, FLOPs and operators are its embedding's or head's plus so many layers'.
So a run of ``L = P x v x n`` layers (``P`` pipeline ranks of ``v`` stages each, ``n`` layers a
stage) is planned at ``n = 1`` and ``n = 2``, and each figure extended to ``n``:
``E(n) = E(1) + (n - 1) (E(2) - E(1))``, which is the whole plan's exactly. Llama-3 70B at TP4 x PP8
on 64 ranks plans in about 3 s so, 7 s whole.

Where the layers are not alike (DeepSeek's dense first layers, sliding and global attention in
turn, an MoE layer every other one), the extension would be wrong, and the run is planned whole.
Only the families whose layers are alike whatever their config (:data:`ALIKE`) are extended, and
only from a config that lists no layers one by one; as a check, the pipeline ranks' added layers
must cost the same (each rank's ``E(2) - E(1)``), and with one pipeline rank a third plan
(``n = 3``) must lie on the line. Runs whose figures do not grow by whole layers are planned whole
too: ``--recompute-method block``, ``--recompute-num-layers`` above 1, ``--checkpoint-ratio``,
virtual stages that do not divide the layers, DeepSpeed's ZeRO-3 (its live-parameter limit caps
what it gathers), a model whose depth no flag or plain HF config directory gives, or a run loaded
from a checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_slapo.checkpoints.checkpoint_files import LATEST
from megatron_slapo.errors import ConfigError
from megatron_slapo.estimates.estimate import RankEstimate

Planner = Callable[[list[str]], list[RankEstimate]]  # argv -> each pipeline stage's first rank's estimate
WHOLE = ("--checkpoint-ratio", "--load", "--load-hf", "--deepspeed-config")  # flags whose runs are planned whole
# model types whose layers are all alike, whatever their config: their transformers classes build
# one layer class, one shape (an MoE family's dense or sparse layers, a sliding window: not here)
ALIKE = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "opt", "gpt_neox", "phi3", "gemma")
_configs = tempfile.TemporaryDirectory(prefix="slapo-shallow-")  # the shallow HF configs, for this process


def _value(argv: list[str], flag: str) -> str | None:
    """The last value ``argv`` gives ``flag`` (``--flag V`` or ``--flag=V``), else None."""
    found = None
    for i, token in enumerate(argv):
        if token == flag and i + 1 < len(argv):
            found = argv[i + 1]
        elif token.startswith(flag + "="):
            found = token.split("=", 1)[1]
    return found


def _replaced(argv: list[str], flag: str, value: str) -> list[str]:
    """``argv`` with ``flag``'s value(s) set to ``value``."""
    out, skip = [], False
    for token in argv:
        if skip:
            out.append(value)
            skip = False
        elif token == flag:
            out.append(token)
            skip = True
        else:
            out.append(f"{flag}={value}" if token.startswith(flag + "=") else token)
    return out


def _hf_config(argv: list[str]) -> dict[str, Any] | None:
    """The plain ``config.json`` of ``--hf-config DIR`` (not a checkpoint's) of an :data:`ALIKE`
    family that lists no layers one by one, else None."""
    source = _value(argv, "--hf-config")
    path = Path(source or "", "config.json")
    if not source or not path.is_file() or (path.parent / LATEST).exists():  # a checkpoint's: planned whole
        return None
    try:
        config = json.loads(path.read_text())
    except ValueError:  # the run refuses it, as itself
        return None
    layers = config.get("num_hidden_layers") if isinstance(config, dict) else None
    if not isinstance(layers, int) or config.get("model_type") not in ALIKE or config.get("use_sliding_window"):
        return None  # (Qwen's sliding window: on some layers only)
    if any(isinstance(v, list) and len(v) == layers for v in config.values()):
        return None
    return config


def _depth(argv: list[str]) -> tuple[int, dict[str, Any] | None]:
    """The run's layers (0 where neither ``--num-layers`` nor a plain HF config gives them) and its
    HF config (None: the flags shape the model)."""
    config = _hf_config(argv)
    if config is not None:
        return config["num_hidden_layers"], config
    layers = _value(argv, "--num-layers")
    alike = (_value(argv, "--model-type") or "gpt2") in ALIKE  # the flags shape a model of that type
    given = layers and layers.isdigit() and _value(argv, "--hf-config") is None
    return (int(layers), None) if given and alike else (0, None)


def _with_layers(argv: list[str], config: dict[str, Any] | None, layers: int) -> list[str]:
    """``argv`` for a run of ``layers`` layers (a copy of its HF config with that depth)."""
    if config is None:
        return _replaced(argv, "--num-layers", str(layers))
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
    folder = Path(_configs.name, f"{digest}-{layers}")
    if not folder.is_dir():
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    return _replaced(argv, "--hf-config", str(folder))


def _extend(a: Any, b: Any, n: int) -> Any:
    """The value at ``n`` layers a stage of a figure that is ``a`` at 1 and ``b`` at 2 (numbers,
    and dicts, lists and dataclasses of them, alike in shape)."""
    if isinstance(a, bool) or isinstance(a, str) or a is None:
        return b
    if isinstance(a, (int, float)):
        value = a + (n - 1) * (b - a)
        return round(value) if isinstance(a, int) and isinstance(b, int) else value
    if isinstance(a, dict):
        if a.keys() != b.keys():
            raise _NotAlike
        return {k: _extend(a[k], b[k], n) for k in a}
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            raise _NotAlike
        return type(a)(_extend(x, y, n) for x, y in zip(a, b, strict=True))
    if dataclasses.is_dataclass(a):
        return dataclasses.replace(a, **{f.name: _extend(getattr(a, f.name), getattr(b, f.name), n)
                                         for f in dataclasses.fields(a) if f.init})  # fmt: skip
    raise _NotAlike


class _NotAlike(Exception):
    """The shallow plans differ in more than their figures: the run is planned whole."""


def _growth(e1: RankEstimate, e2: RankEstimate) -> tuple:
    """What a stage's added layer costs, in the figures that tell unlike layers apart."""
    return (e2.flops - e1.flops, e2.activations - e1.activations,
            {k: e2.memory[k] - e1.memory.get(k, 0) for k in e2.memory})  # fmt: skip


def _plain_recompute(argv: list[str]) -> bool:
    """Recomputation, if any, that grows by whole layers: selective, or full of one layer at a time."""
    if _value(argv, "--recompute-granularity") != "full":
        return True
    return _value(argv, "--recompute-method") == "uniform" and (_value(argv, "--recompute-num-layers") or "1") == "1"


def shallow_explain(argv: list[str], plan: Planner) -> list[RankEstimate] | None:
    """``plan(argv)``'s estimates, from the run planned at one and two layers a stage and extended
    (see the module docstring), or None where that would not be exact, or a shallow run is refused
    (then plan it whole: it is refused, if at all, as itself)."""
    layers, config = _depth(argv)
    try:
        pp = int(_value(argv, "--pipeline-model-parallel-size") or 1)
        per_virtual = int(_value(argv, "--num-layers-per-virtual-pipeline-stage") or 0)
    except ValueError:  # the run refuses it, as itself
        return None
    if layers <= 0 or pp <= 0 or per_virtual < 0 or (per_virtual and layers % (pp * per_virtual)):
        return None
    stages = pp * (layers // (pp * per_virtual) if per_virtual else 1)
    enough = 4 if pp == 1 else 3  # layers a stage from which the shallow plans are fewer (one rank: three plans)
    if layers % stages or layers // stages < enough or any(_value(argv, f) for f in WHOLE):
        return None
    if not _plain_recompute(argv) or _value(argv, "--zero-stage") == "3":
        return None

    def shallow(n: int) -> list[RankEstimate]:
        shallow_argv = _with_layers(argv, config, n * stages)
        if per_virtual:
            shallow_argv = _replaced(shallow_argv, "--num-layers-per-virtual-pipeline-stage", str(n))
        return plan(shallow_argv)

    try:
        one, two, n = shallow(1), shallow(2), layers // stages
        if pp > 1 and len({repr(_growth(a, b)) for a, b in zip(one, two, strict=True)}) > 1:
            return None  # the ranks' added layers cost differently: layers unlike
        if pp == 1:
            three = shallow(3)
            guess = [_extend(a, b, 3) for a, b in zip(one, two, strict=True)]
            if [(e.flops, e.activations, e.memory) for e in guess] != [(e.flops, e.activations, e.memory)
                                                                      for e in three]:  # fmt: skip
                return None
        return [_extend(a, b, n) for a, b in zip(one, two, strict=True)]
    except (_NotAlike, ConfigError):  # a shallow run refused (a rule on the depth): the whole run says
        return None
