"""Named RNG streams for tensor parallelism, on CPU and CUDA.

Dropout on a *replicated* activation must draw the same mask on every tensor-parallel rank (the
ranks hold copies of one tensor); dropout on a *partitioned* activation must draw different masks
(the ranks hold different slices). Megatron solves this with a second generator state, the
"model-parallel" stream, seeded per TP rank and swapped in for the regions that are partitioned.
This module is that tracker, written against the generator of whichever device runs the model, so
it behaves the same on a CPU-only machine and on GPUs.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from megatron_slapo.errors import ConfigError

MODEL_PARALLEL_RNG = "model-parallel"
# Megatron's offset between the data-parallel seed and the model-parallel seed.
_MODEL_PARALLEL_SEED_OFFSET = 2718


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _get_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if _device_type() == "cuda" else torch.get_rng_state()


def _set_state(state: torch.Tensor) -> None:
    if _device_type() == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What :meth:`RNGStatesTracker.replay` restores."""

    states: dict[str, torch.Tensor]
    active: frozenset[str]
    live: torch.Tensor | None  # the generator's state, when a stream was forked


class RNGStatesTracker:
    """Holds named generator states and swaps one in for the duration of :meth:`fork`."""

    def __init__(self) -> None:
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: set[int] = set()
        self._active: set[str] = set()  # streams forked now
        self._generation = 0  # bumped by reset(): a fork open across it must not write its stream back

    def reset(self) -> None:
        self._states = {}
        self._seeds = set()
        self._active = set()
        self._generation += 1

    def is_seeded(self, name: str = MODEL_PARALLEL_RNG) -> bool:
        return name in self._states

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` from ``seed`` without disturbing the current generator.

        Like megatron-core's ``CudaRNGStatesTracker.add``, a name or a seed already in use is refused:
        a second stream from the same seed would draw the very masks of the first.
        """
        if seed in self._seeds:
            raise ConfigError(f"RNG seed {seed} is already used by a stream; each stream needs a seed of its own")
        if name in self._states:
            raise ConfigError(f"RNG stream {name!r} already exists; reset() the tracker to seed it anew")
        saved = _get_state()
        try:
            torch.manual_seed(seed) if _device_type() == "cpu" else torch.cuda.manual_seed(seed)
            self._states[name] = _get_state()
            self._seeds.add(seed)
        finally:
            _set_state(saved)

    def get_states(self) -> dict[str, torch.Tensor]:
        """A snapshot of every stream (used by activation checkpointing to replay dropout)."""
        return {k: v.clone() for k, v in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._states = {k: v.clone() for k, v in states.items()}

    def snapshot(self) -> Snapshot:
        """The streams, which of them are forked now and, if any is, the generator's state (that
        stream's live state): what a recompute must replay."""
        return Snapshot(self.get_states(), frozenset(self._active), _get_state() if self._active else None)

    @contextlib.contextmanager
    def replay(self, snapshot: Snapshot) -> Iterator[None]:
        """Run the body with the streams of ``snapshot``. A stream that was forked then is forked
        again, its live state in the generator. (torch's checkpoint restores the CPU generator, but
        a CUDA one only for devices of positional tensor arguments: set it here either way.)"""
        current, current_active = self.get_states(), self._active
        generator = _get_state() if snapshot.live is not None else None
        self.set_states(snapshot.states)
        self._active = set(snapshot.active)
        if snapshot.live is not None:
            _set_state(snapshot.live)
        try:
            yield
        finally:
            self.set_states(current)
            self._active = current_active
            if generator is not None:
                _set_state(generator)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the body on stream ``name``; the default stream resumes where it was afterwards.

        A fork inside a fork of the same stream (a layer forked under sequence parallelism, its
        attention core forked too) keeps drawing from it: swapping in the stored state again would
        replay the outer fork's numbers, so the two dropouts would share their masks.
        """
        if name not in self._states:
            raise RuntimeError(
                f"RNG stream {name!r} is not seeded: call megatron_slapo.parallel.initialize(...) or "
                "megatron_slapo.parallel.seed(...) before running a module scheduled with fork_rng()"
            )
        if name in self._active:
            yield
            return
        saved, generation = _get_state(), self._generation
        _set_state(self._states[name])
        self._active.add(name)
        try:
            yield
        finally:
            if self._generation == generation:  # else reseeded inside: the new streams and seed stand
                self._active.discard(name)
                self._states[name] = _get_state()
                _set_state(saved)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker used by ``fork_rng`` and ``checkpoint``."""
    return _TRACKER


def seed(value: int, tensor_parallel_rank: int = 0, pipeline_parallel_rank: int = 0) -> None:
    """Seed the default generator and the model-parallel stream the way Megatron does.

    The default stream gets ``value + 100 * pp_rank`` (equal across TP ranks, so replicated dropout
    agrees); the model-parallel stream additionally gets ``2718 + tp_rank`` (different per TP rank).
    The generator is the device's: CUDA when available, else the CPU.
    """
    base = value + 100 * pipeline_parallel_rank
    torch.manual_seed(base)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, base + _MODEL_PARALLEL_SEED_OFFSET + tensor_parallel_rank)
