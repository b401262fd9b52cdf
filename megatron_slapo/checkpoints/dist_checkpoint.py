"""``--ckpt-format torch_dist``: checkpoints that any layout and any engine can resume.

Layout (Megatron-LM's ``torch_dist``)::

    SAVE/latest_checkpointed_iteration.txt
    SAVE/iter_0000100/.metadata, __0_0.distcp, __1_0.distcp, ...   (torch.distributed.checkpoint)
    SAVE/iter_0000100/common.pt          (iteration, data position, LR schedule, loss scale, RNG, args)
    SAVE/iter_0000100/metadata.json      ({"sharded_backend": "torch_dist", ...}: how to read the rest)

Every tensor is stored once under its global identity: ``model.<HF name>`` (the fp32 main weight
where the engine keeps one) and ``optimizer.<HF name>.exp_avg`` / ``.exp_avg_sq``, in the HF
model's shape (a tied weight under the name it is tied to; a vocabulary with the padding rows of
the run that saved it, which train as Megatron's do: a run padding to another size reads the rows
both have, see :class:`Identity`).
Each rank writes the boxes of those tensors it holds (:mod:`~megatron_slapo.engines.sharded_state`
says what an engine holds, :mod:`~megatron_slapo.parallel.shard_geometry` where it lies), and on
load reads the boxes it needs from whichever files hold them: a checkpoint resumes at another
tensor-, pipeline- or data-parallel size and on another engine, nothing ever gathered whole on one
rank. The RNG states are restored only at the layout that saved them (they are per rank).

The iteration is written into ``iter_N.tmp`` and committed as in the ``torch`` format
(:func:`~megatron_slapo.checkpoints.checkpoint_files.commit`, checksums included). With ``--async-save``
the tensors are copied to the CPU, the step loop goes on while a background thread writes them,
and the commit (which alone moves ``latest``) happens once every rank's files are durable
(:class:`AsyncSaves`): a run killed mid-save resumes from the checkpoint before.
"""

from __future__ import annotations

import argparse
import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from transformers import PretrainedConfig

from megatron_slapo.checkpoints import checkpoint_integrity as integrity
from megatron_slapo.checkpoints.checkpoint_files import Resume, finish_save, iteration_dir, start_save
from megatron_slapo.checkpoints.dcp_planners import PieceLoadPlanner, Pieces, PieceSavePlanner
from megatron_slapo.checkpoints.rng_state import rng_state, set_rng_state
from megatron_slapo.checkpoints.saved_model import SavedModel, check_same_model
from megatron_slapo.engines.base import Engine
from megatron_slapo.engines.sharded_state import WEIGHT, EngineState
from megatron_slapo.errors import CheckpointError
from megatron_slapo.parallel.agreement import agreed_errors
from megatron_slapo.parallel.collectives import comm_device
from megatron_slapo.parallel.shard_geometry import Placement, global_pieces
from megatron_slapo.parallel.state import Layout

FORMAT_FILE = "metadata.json"  # Megatron-LM's: names the backend of a distributed checkpoint
COMMON = "common.pt"
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
           "common_backend_version": 1}  # fmt: skip


def is_dist_checkpoint(root: str) -> bool:
    """Whether the iteration directory ``root`` holds a ``torch_dist`` checkpoint."""
    path = os.path.join(root, FORMAT_FILE)
    if not os.path.isfile(path):  # a copy that lost it is still DCP's if its metadata is there
        return os.path.isfile(os.path.join(root, ".metadata"))
    try:
        with open(path) as f:
            return json.load(f).get("sharded_backend") == "torch_dist"
    except (OSError, ValueError):
        return False


@dataclass(frozen=True)
class Identity:
    """How a rank's tensors are named and shaped in the checkpoint: ``tied`` maps a tied weight's
    name to the one it is stored under (HF's ``all_tied_weights_keys``). A vocabulary is stored
    with the padding rows of the run that saved it (they train: the loss is over the padded
    vocabulary, as Megatron's); ``vocab_rows``, on load, gives the saved row count of each tensor
    with a vocabulary as dim 0, so that a run padding to another size reads the rows both have."""

    tied: dict[str, str]
    vocab_rows: dict[str, int]

    @classmethod
    def of(cls, metadata: dict[str, Any], saved: dict[str, Any] | None = None) -> Identity:
        """From the run's checkpoint metadata (:func:`~megatron_slapo.checkpoints.checkpointing.export_metadata`)
        and, on load, the saved tensors' metadata (DCP's)."""
        tied = dict(metadata.get("tied", {}))
        rows = {}
        for name in (metadata.get("vocab") or {}).get("params", []) if saved else []:
            found = saved.get(f"model.{tied.get(name, name)}")
            if found is not None and len(found.size):
                rows[name] = found.size[0]
        return cls(tied, rows)

    def key(self, names: list[str], kind: str) -> str:
        """The checkpoint key of state ``kind`` of the tensor named ``names`` here."""
        name = self.tied.get(names[0], names[0])
        return f"model.{name}" if kind == WEIGHT else f"optimizer.{name}.{kind}"


def pieces_of(state: EngineState, layout: Layout, identity: Identity) -> Pieces:
    """Every tensor of ``state`` as boxes of the global tensors, by checkpoint key."""
    out: Pieces = {}
    for p in state.params:
        rows = next((identity.vocab_rows[n] for n in p.names if n in identity.vocab_rows), None)
        placement = Placement(tuple(p.shape), p.partition, layout.tp_rank, layout.tp_size, rows, p.experts)
        for kind, run in p.tensors.items():
            shape, boxes = out.setdefault(identity.key(p.names, kind), (placement.global_shape, []))
            boxes += [(box, t) for box, t in global_pieces(placement, run.data, run.start) if t.numel()]
    return out


def _write(root: str, pieces: Pieces, balanced: bool, group: dist.ProcessGroup | None) -> dict[str, str]:
    """Write this rank's boxes into ``root`` (collective over ``group``); then, every rank's files
    being written (DCP's save ends in a collective), the checksums of this rank's share of them."""
    writer = dcp.FileSystemWriter(root, sync_files=True)
    dcp.save({}, storage_writer=writer, planner=PieceSavePlanner(pieces, balanced), process_group=group)
    return integrity.checksum_share(root)


class AsyncSaves:
    """``--async-save``: at most one save in flight, written by a background thread over a process
    group of its own (gloo: the copies are on the CPU), committed once every rank has finished."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="async-save")
        self.group: dist.ProcessGroup | None = None
        self.pending: tuple[Future, str, int] | None = None

    def start(self, save_dir: str, iteration: int, pieces: Pieces, balanced: bool) -> None:
        """Copy ``pieces`` to the CPU and write them in the background (collective: every rank;
        :func:`save` has committed the save before)."""
        if self.group is None:
            self.group = dist.new_group(backend="gloo")
        copies: Pieces = {k: (shape, [(box, t.detach().to("cpu", copy=True)) for box, t in boxes])
                          for k, (shape, boxes) in pieces.items()}  # fmt: skip
        tmp = iteration_dir(save_dir, iteration) + ".tmp"
        self.pending = (self.pool.submit(_write, tmp, copies, balanced, self.group), save_dir, iteration)

    def poll(self) -> None:
        """Commit the save in flight if every rank has written its files (collective: one small
        all-reduce, only while a save is in flight)."""
        if self.pending is None:
            return
        done = torch.tensor([1.0 if self.pending[0].done() else 0.0], device=comm_device())
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item() == 1.0:
            self.wait()

    def wait(self) -> None:
        """Wait for the save in flight and commit it (collective)."""
        if self.pending is None:
            return
        future, save_dir, iteration = self.pending
        self.pending = None
        finish_save(save_dir, iteration, future.result())
        if dist.get_rank() == 0:
            print(f"  successfully saved checkpoint at iteration {iteration:7d} to {save_dir} (async)", flush=True)


def save(engine: Engine, args: argparse.Namespace, layout: Layout, common: dict[str, Any], identity: Identity,
         asynchronous: AsyncSaves | None = None) -> str:  # fmt: skip
    """Write iteration ``common["iteration"]`` to ``args.save``: ``common`` (rank 0's, with the
    engine's scalars and every rank's RNG state gathered here) into ``common.pt``, the engine's
    tensors by DCP; committed now, or by ``asynchronous`` once written. Collective."""
    iteration = common["iteration"]
    if asynchronous is not None:
        asynchronous.wait()  # the one before is committed before this one starts
    if dist.get_rank() == 0:
        print(f"saving checkpoint at iteration {iteration:7d} to {args.save} in torch_dist format", flush=True)
    tmp = start_save(args.save, iteration)
    state = engine.sharded_state(include_optimizer=not args.no_save_optim)
    rng: list[Any] = [None] * dist.get_world_size()
    if not args.no_save_rng:  # every rank's, kept by rank 0 (restored at the same layout only)
        dist.all_gather_object(rng, rng_state())
    if dist.get_rank() == 0:
        full = {**common, "scalars": state.scalars, "has_optimizer": not args.no_save_optim}
        if not args.no_save_rng:
            full["rng_state"] = rng
        with open(os.path.join(tmp, COMMON), "wb") as f:
            torch.save(full, f)
        with open(os.path.join(tmp, FORMAT_FILE), "w") as f:
            json.dump(BACKEND, f)
    pieces = pieces_of(state, layout, identity)
    balanced = args.ckpt_fully_parallel_save
    if asynchronous is not None:
        asynchronous.start(args.save, iteration, pieces, balanced)
        return iteration_dir(args.save, iteration)
    finish_save(args.save, iteration, _write(tmp, pieces, balanced, None))
    if dist.get_rank() == 0:
        print(f"  successfully saved checkpoint at iteration {iteration:7d} to {args.save}", flush=True)
    return iteration_dir(args.save, iteration)


def read_common(root: str) -> dict[str, Any]:
    """The iteration's ``common.pt``, checked against its checksum."""
    path = os.path.join(root, COMMON)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing: the checkpoint in {root} is incomplete")
    integrity.verify(root, [COMMON], integrity.recorded_checksums(root))
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {type(e).__name__}: {str(e)[:200]}") from e


def check_model_shapes(root: str, shapes: dict[str, tuple[int, ...]], metadata: dict[str, Any]) -> None:
    """Refuse, as :func:`load` would, the checkpoint ``root`` when it lacks a tensor of a model of
    these global ``shapes`` (by HF name) or holds one of another shape; ``metadata``: the model's
    tied weights and vocabulary tensors (:func:`~megatron_slapo.checkpoints.checkpointing.export_metadata`),
    whose saved rows may differ (a run reads the rows both have). For ``tools/explain.py``, which
    plans the run without loading it."""
    saved = dcp.FileSystemReader(root).read_metadata().state_dict_metadata
    identity = Identity.of(metadata, saved)
    expected: Pieces = {}
    for name, shape in shapes.items():
        rows = identity.vocab_rows.get(name)
        expected[identity.key([name], WEIGHT)] = ((rows, *shape[1:]) if rows is not None else shape, [])
    _check_shapes(expected, saved, root)


def _check_shapes(pieces: Pieces, saved: dict[str, Any], root: str) -> None:
    """Refuse a checkpoint lacking a tensor this rank loads, or holding one of another global shape."""
    for key, (shape, _) in pieces.items():
        found = saved.get(key)
        if found is None:
            raise CheckpointError(f"{root} has no tensor {key}: it was saved from another model (or without the "
                                  "optimizer state: pass --no-load-optim)")  # fmt: skip
        if tuple(found.size) != tuple(shape):
            raise CheckpointError(f"{root} holds {key} of shape {tuple(found.size)}, this model's is {tuple(shape)}: "
                                  "the checkpoint is of another model (check --num-layers, --hidden-size, ...)")  # fmt: skip


def _check_finite(pieces: Pieces, root: str) -> None:
    """Refuse non-finite values among those this rank loaded (the ranks together check them all)."""
    for key, (_, boxes) in pieces.items():
        finite = [torch.isfinite(t).all() for _, t in boxes if t.is_floating_point()]
        if finite and not bool(torch.stack(finite).all()):  # one device sync per tensor
            raise CheckpointError(f"{root} holds non-finite values in {key}: it was saved from a diverged run; "
                                  "load an earlier iteration")  # fmt: skip


def load(engine: Engine, root: str, common: dict[str, Any], layout: Layout, metadata: dict[str, Any],
         load_optimizer: bool) -> None:  # fmt: skip
    """Load the tensors of the checkpoint in ``root`` into ``engine`` (the optimizer's with
    ``load_optimizer``), resharding as needed, and the engine's scalars; ``metadata``: the run's
    (:func:`~megatron_slapo.checkpoints.checkpointing.export_metadata`). Collective."""
    reader = dcp.FileSystemReader(root)
    saved = reader.read_metadata().state_dict_metadata
    identity = Identity.of(metadata, saved)
    padded = (metadata.get("vocab") or {}).get("padded")
    rows = sorted(set(identity.vocab_rows.values()) - {padded})
    if rows and dist.get_rank() == 0:
        print(f" > note: the checkpoint's vocabulary is padded to {rows[0]} rows, this run's to {padded}: "
              f"{'rows past ' + str(rows[0]) + ' start afresh' if rows[0] < padded else 'the extra rows are not read'}",
              flush=True)  # fmt: skip

    def fill(state: EngineState) -> None:
        pieces = pieces_of(state, layout, identity)
        with agreed_errors(CheckpointError):
            _check_shapes(pieces, saved, root)
        dcp.load({}, storage_reader=reader, planner=PieceLoadPlanner(pieces))
        with agreed_errors(CheckpointError):
            _check_finite(pieces, root)
        state.scalars = dict(common.get("scalars", {}))

    engine.load_sharded_state(fill, load_optimizer=load_optimizer)


# -- what the trainer asks: the checks before building, and the resume -------------------------------
def layout_record(args: argparse.Namespace, world: int) -> dict[str, Any]:
    """The layout of a run of ``world`` ranks with ``args`` (kept in ``common.pt``, printed when another
    layout loads it)."""
    engine = getattr(args, "engine", "ddp")
    if engine == "deepspeed":
        engine = f"deepspeed ZeRO-{args.zero_stage}"
    elif engine == "megatron" and getattr(args, "use_distributed_optimizer", False):
        engine = "megatron with the distributed optimizer"
    tp, pp, cp = (
        args.tensor_model_parallel_size,
        getattr(args, "pipeline_model_parallel_size", 1),
        getattr(args, "context_parallel_size", 1),
    )
    record = {"tensor": tp, "pipeline": pp, "data": world // (tp * pp * cp), "engine": engine,
              "virtual": getattr(args, "num_layers_per_virtual_pipeline_stage", None)}  # fmt: skip
    if getattr(args, "expert_model_parallel_size", 1) > 1:  # recorded only when on: older records have none
        record["expert"] = args.expert_model_parallel_size
    if cp > 1:
        record["context"] = cp
    return record


def resharding(saved: dict[str, Any], here: dict[str, Any]) -> str:
    """``saved at TP2 x PP2 x DP1, megatron; this run: ... (resharding)``."""
    how = "same layout" if saved == here else "resharding"
    return f"saved at {layout_text(saved)}; this run: {layout_text(here)} ({how})"


def layout_text(record: dict[str, Any]) -> str:
    """``TP2 x PP2 x DP1, megatron`` (virtual stages when there are)."""
    virtual = f" (virtual stages of {record['virtual']} layers)" if record.get("virtual") else ""
    experts = f" (EP{record['expert']})" if record.get("expert") else ""
    context = f" x CP{record['context']}" if record.get("context") else ""
    return (f"TP{record['tensor']} x PP{record['pipeline']}{virtual} x DP{record['data']}{context}{experts}, "
            f"{record['engine']}")  # fmt: skip


def _same_ranks(saved: dict[str, Any], here: dict[str, Any]) -> bool:
    """Whether every rank of this run is the rank that saved (so its RNG state is its own)."""
    return all(saved.get(k) == here.get(k) for k in ("tensor", "pipeline", "data", "virtual", "context"))


def read_checked(args: argparse.Namespace, root: str, model: PretrainedConfig) -> dict[str, Any]:
    """The checkpoint's common state, checked against this run (``model``: its HF config, see
    :func:`~megatron_slapo.checkpoints.saved_model.check_same_model`) and its flags before anything
    is built; every rank verifies a share of the iteration's files."""
    common = read_common(root)
    integrity.verify_share(root, skip={COMMON})
    load_optimizer = not (args.finetune or args.no_load_optim)
    integrity.check_finite(
        {"scalars": common.get("scalars"), "args": common.get("args")},
        os.path.join(root, COMMON),
        with_optimizer=load_optimizer,
    )
    check_same_model(SavedModel.of(root, common), model)
    restoring_rng = not (args.finetune or args.no_load_rng) and common.get("iteration", 0) > 0
    if (
        restoring_rng
        and _same_ranks(common.get("layout", {}), layout_record(args, dist.get_world_size()))
        and "rng_state" not in common
    ):
        raise CheckpointError(f"{root} holds no RNG state (saved with --no-save-rng); pass --no-load-rng "
                              "(or --finetune) to resume without it")  # fmt: skip
    return common


def resume(engine: Engine, args: argparse.Namespace, layout: Layout, root: str, common: dict[str, Any],
           metadata: dict[str, Any]) -> Resume:  # fmt: skip
    """Load the checkpoint ``root`` (its ``common`` state as :func:`read_checked` returned it) into
    ``engine`` at this run's layout, honouring --finetune / --no-load-optim / --no-load-rng; say
    which layout saved it and whether it is resharding. Collective."""
    rank0 = dist.get_rank() == 0
    wanted = not (args.finetune or args.no_load_optim)
    if wanted and not common.get("has_optimizer") and common.get("iteration", 0) > 0 and rank0:
        print(f" > WARNING: {root} has no optimizer state (saved with --no-save-optim): the optimizer and the LR "
              "schedule start afresh", flush=True)  # fmt: skip
    saved, here = common.get("layout", {}), layout_record(args, dist.get_world_size())
    if rank0 and saved:
        print(f" > checkpoint {resharding(saved, here)}", flush=True)
    with agreed_errors(CheckpointError):
        try:
            with_optimizer = wanted and bool(common.get("has_optimizer"))
            load(engine, root, common, layout, metadata, load_optimizer=with_optimizer)
        except RuntimeError as e:  # a shape the engine refuses
            raise CheckpointError(f"{root} does not fit this model: {str(e)[:300]}") from e
    if args.finetune or common.get("iteration", 0) == 0:
        return Resume()
    if not args.no_load_rng and _same_ranks(saved, here):
        set_rng_state(common["rng_state"][dist.get_rank()])
    elif not args.no_load_rng and rank0:
        print(" > note: RNG states not restored (they are per rank, and the ranks changed)", flush=True)
    return Resume(common["iteration"], common["consumed_train_samples"], common["consumed_valid_samples"])
