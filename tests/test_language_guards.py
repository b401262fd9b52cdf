"""Schedules the language must refuse up front (or carry out exactly), found by running Slapo's own
test cases on our API: sharding a layer whose forward is not the one we know, hooks on layers that
a traced graph no longer calls, subgraph replacements that would change what hooks see or that
cannot be called, and RNG streams that would repeat each other."""

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

import megatron_slapo as ms
from megatron_slapo.errors import ConfigError
from megatron_slapo.kernels.linear import DecomposedLinear
from megatron_slapo.module_surgery import base_forward
from megatron_slapo.parallel.random import RNGStatesTracker, get_rng_tracker, seed
from megatron_slapo.primitives.sync import RowParallelForward

X = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))


# ----- shard: a Linear / Conv1D / Embedding subclass with a forward of its own --------------------------
class ScaledLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


class ScaledConv1D(Conv1D):
    def forward(self, x):
        return torch.tanh(super().forward(x))


class ScaledEmbedding(nn.Embedding):  # like HF's scaled word embeddings (Gemma, BART)
    def forward(self, ids):
        return super().forward(ids) * 4.0


class PlainSubclass(nn.Linear):
    """Inherits nn.Linear's forward: its maths is known."""


@pytest.mark.parametrize(
    ("make", "axis", "inputs"),
    [
        (lambda: ScaledLinear(8, 8), 1, X),
        (lambda: ScaledConv1D(8, 8), 0, X),  # Conv1D stores W^T: axis 0 is its input features
        (lambda: ScaledEmbedding(16, 8), 0, torch.tensor([[1, 5, 15]])),
    ],
    ids=["linear-row", "conv1d-row", "embedding-vocab"],
)
def test_sharding_that_would_replace_a_subclass_forward_is_refused_untouched(make, axis, inputs):
    torch.manual_seed(0)
    layer = make()
    if getattr(layer, "bias", None) is not None:
        nn.init.normal_(layer.bias)  # Conv1D starts it at zero: make the bias count
    model = nn.Sequential(layer)
    expected = model(inputs)
    weight = layer.weight
    sch = ms.create_schedule(model)
    with pytest.raises(ms.SchedulingError, match=rf"\[0\] cannot shard 'weight' on axis {axis}: {type(layer).__name__} "
                       rf"overrides forward\(\).*replace\(\) the layer with a plain"):  # fmt: skip
        sch["0"].shard("weight", axis=axis)
    assert layer.weight is weight and "forward" not in vars(layer) and not sch["0"].metadata.shards
    assert torch.equal(model(inputs), expected)


def test_sharding_keeps_a_subclass_computation_where_it_needs_no_rewrite():
    """Column sharding and a bias-less row-parallel layer keep the subclass's own forward; known
    forwards (a subclass that does not override it, a decomposed Linear) are rewritten as before."""
    torch.manual_seed(0)
    cases = [
        (ScaledLinear(8, 8), 0),  # column: the forward is kept
        (ScaledLinear(8, 8, bias=False), 1),  # row without a bias: nothing to move after the reduction
        (PlainSubclass(8, 8), 1),  # row with a bias, the forward is nn.Linear's
        (DecomposedLinear(8, 8), 1),  # matmul then bias add: the same maths
    ]
    for layer, axis in cases:
        model = nn.Sequential(layer)
        expected = model(X)
        ms.create_schedule(model)["0"].shard("weight", axis=axis)  # one process: the whole tensor
        rewritten = isinstance(base_forward(layer), RowParallelForward)
        assert rewritten == (axis == 1 and layer.bias is not None), type(layer).__name__
        assert torch.allclose(model(X), expected, atol=1e-6, rtol=0), type(layer).__name__


# ----- sync / hook on a layer that a traced graph no longer calls ------------------------------------
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.fc(x))


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        return self.out(self.block(x))


def _decomposed_then_traced():
    sch = ms.create_schedule(Block())
    sch["fc"].decompose()
    sch.trace(example_inputs=X)  # fc is traced through: its matmul and bias add are in the root graph
    return sch


def _traced_then_decomposed():
    sch = ms.create_schedule(Block())
    sch.trace(example_inputs=X)
    sch["fc"].decompose()  # rewritten in the graph: fc is no longer called
    return sch


@pytest.mark.parametrize("make", [_decomposed_then_traced, _traced_then_decomposed], ids=["before", "after"])
def test_sync_and_hook_on_a_traced_through_layer_are_refused(make):
    sch = make()
    never = r"does not call fc as a module .* so it would never run"
    with pytest.raises(
        ms.SchedulingError, match=rf"\[fc\] hook\('fwd_post'\) cannot apply: the traced graph of <root> {never}"
    ):
        sch["fc"].hook("fwd_post", lambda m, a, o: o * 100)
    for mode, op in (("fwd_post", lambda t: t * 100), ("fwd_pre", lambda t: t * 100), ("bwd_post", "all_reduce")):
        with pytest.raises(ms.SchedulingError, match=rf"\[fc\] sync\('{mode}'\) cannot apply: .*{never}"):
            sch["fc"].sync(mode, op)
    assert not sch["fc"].metadata.syncs
    calls = []
    sch["act"].hook("fwd_post", lambda m, a, o: calls.append(1))  # still called by the graph: fine
    sch.mod(X)
    assert calls == [1]


def test_sync_or_hook_then_decompose_then_trace_is_refused_by_trace():
    for primitive in ("hook", "sync"):
        sch = ms.create_schedule(Block())
        if primitive == "hook":
            sch["fc"].hook("fwd_post", lambda m, a, o: o * 100)
        else:
            sch["fc"].sync("fwd_post", lambda t: t * 100)
        sch["fc"].decompose()  # the hook moves onto the decomposed layer, which tracing would inline
        with pytest.raises(ms.SchedulingError, match=r"fc has .*forward hooks; trace\(\) before those primitives"):
            sch.trace(example_inputs=X)


def test_hooks_below_a_flattened_or_a_leaf_level():
    """flatten=True inlines the intermediate modules (refused); an untraced leaf level still runs
    its children eagerly (accepted, and the hook runs)."""
    flat = ms.create_schedule(Outer())
    flat.trace(example_inputs=X, flatten=True)
    with pytest.raises(ms.SchedulingError, match=r"\[block\] hook.*does not call block as a module"):
        flat["block"].hook("fwd_pre", lambda m, a: None)
    calls = []
    flat["block.fc"].hook("fwd_post", lambda m, a, o: calls.append("flat"))  # a leaf: still a call
    leafy = ms.create_schedule(Outer())
    leafy.trace(example_inputs=X, leaf_modules=[Block])
    leafy["block.fc"].hook("fwd_post", lambda m, a, o: calls.append("leaf"))  # Block runs eagerly
    flat.mod(X)
    leafy.mod(X)
    assert calls == ["flat", "leaf"]


def test_checkpoint_and_fork_rng_on_a_traced_through_module_are_refused():
    """Both wrap the module's forward, which a flattened graph never calls: refused, not dropped."""
    flat = ms.create_schedule(Outer())
    flat.trace(example_inputs=X, flatten=True)
    with pytest.raises(ms.SchedulingError, match=r"\[block\] checkpoint\(\) cannot apply: .*does not call block"):
        flat["block"].checkpoint()
    with pytest.raises(ms.SchedulingError, match=r"\[block\] fork_rng\(\) cannot apply: .*does not call block"):
        flat["block"].fork_rng()
    assert not flat["block"].metadata.checkpointed and not flat["block"].metadata.forked_rng
    flat["out"].checkpoint()  # a leaf the graph calls: fine
    flat["out"].fork_rng()


# ----- replace(target_ops=...): train/eval mode, hooks, arity ------------------------------------------
class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.fc(x)) + 1.0


class FcTanhPattern(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class FcTanh(nn.Module):
    """A replacement for ``tanh(fc(x))``, with a dropout after it."""

    def __init__(self, fc=None, p=0.0):
        super().__init__()
        self.fc = fc if fc is not None else nn.Linear(8, 8)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return self.drop(torch.tanh(self.fc(x)))


def traced_chain(train=True):
    torch.manual_seed(0)
    model = Chain().train(train)
    expected = model(X)
    sch = ms.create_schedule(model)
    sch.trace(example_inputs=X)
    return sch, expected


def test_a_spliced_module_takes_the_owners_eval_mode():
    sch, expected = traced_chain(train=False)
    (sub,) = sch.find(FcTanhPattern())
    new = FcTanh(sch["fc"].mod, p=0.5)  # dropout: live in train mode, the identity in eval mode
    sch.replace(new, target_ops=sub, name="fc_tanh")
    assert not new.training and not new.drop.training
    assert torch.equal(sch.mod(X), expected)
    sch.mod.train()
    assert new.drop.training


def test_a_hook_of_an_inner_layer_is_refused_and_one_that_sees_the_same_tensor_moves():
    sch, _ = traced_chain()
    (sub,) = sch.find(FcTanhPattern())
    sch["fc"].hook("fwd_post", lambda m, a, o: None)  # fc's output is inside the subgraph
    with pytest.raises(ms.SchedulingError, match=r"\[<root>\] cannot replace the subgraph: the fwd_post hook\(s\) "
                       r"of fc would run on the replacement and see other tensors than fc's"):  # fmt: skip
        sch.replace(FcTanh(sch["fc"].mod), target_ops=sub)
    assert "fc" in sch.child and sch.mod.fc._forward_hooks  # nothing changed

    sch, expected = traced_chain()
    seen = []
    sch["fc"].hook("fwd_pre", lambda m, args: seen.append(args[0]))  # fc alone reads the input
    (sub,) = sch.find(FcTanhPattern())
    new = FcTanh(sch["fc"].mod)
    sch.replace(new, target_ops=sub)
    assert torch.equal(sch.mod(X), expected) and len(seen) == 1 and seen[0] is X
    with pytest.raises(ms.SchedulingError, match=r"hook\(s\) of fctanh cannot move onto a function"):
        sch.replace(lambda x: torch.tanh(new.fc(x)), target_ops=sch.find(r"^fctanh$")[0])


class Shared(nn.Module):
    """One layer called twice."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.fc(x)) + self.fc(x)


def test_a_hooked_layer_still_called_outside_the_subgraph_is_refused():
    sch = ms.create_schedule(Shared())
    sch.trace(example_inputs=X)
    sch["fc"].hook("fwd_pre", lambda m, args: None)
    first = sch.find(r"^fc$")[0]
    with pytest.raises(ms.SchedulingError, match=r"hook\(s\) of fc would leave its calls outside the subgraph"):
        sch.replace(FcTanh(), target_ops=first)


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Block()

    def forward(self, x):
        return self.inner(x) * 2


class NewBlock(nn.Module):
    """Same maths as Block, another parameter name: the old level's call guard must not follow."""

    def __init__(self, old):
        super().__init__()
        self.fc, self.act = old.fc, old.act

    def forward(self, inp):
        return self.act(self.fc(inp))


def test_replacing_a_traced_level_drops_its_call_guard():
    torch.manual_seed(0)
    model = Pair()
    expected = model(X)
    sch = ms.create_schedule(model)
    sch.trace(example_inputs=X)  # inner is a traced level, guarded for calls like Block.forward(x)
    (sub,) = sch.find(r"^inner$")
    new = NewBlock(sch["inner"].mod)
    sch.replace(new, target_ops=sub, name="new_block")
    assert not new._forward_pre_hooks
    assert torch.equal(sch.mod(X), expected)


def test_a_callee_that_cannot_take_the_subgraph_inputs_is_refused_up_front():
    sch, expected = traced_chain()
    (sub,) = sch.find(lambda a: torch.tanh(a))
    with pytest.raises(ms.SchedulingError, match=r"\[<root>\] cannot replace the subgraph: it has 1 input\(s\), and "
                       r"<lambda>\(a, b\) cannot take them \(missing a required argument: 'b'\)"):  # fmt: skip
        sch.replace(lambda a, b: torch.tanh(a + b), target_ops=sub)

    class TwoInputs(nn.Module):
        def forward(self, a, b):
            return a + b

    with pytest.raises(ms.SchedulingError, match=r"TwoInputs\(a, b\) cannot take them"):
        sch.replace(TwoInputs(), target_ops=sub)

    class Keyword(nn.Module):
        def forward(self, a, *, scale):
            return a * scale

    with pytest.raises(ms.SchedulingError, match=r"Keyword\(a, \*, scale\) cannot take them"):
        sch.replace(Keyword(), target_ops=sub)
    assert "tanh" in {n.name for n in sch.mod.graph.nodes}  # nothing changed
    sch.replace(lambda *values: torch.tanh(values[0]), target_ops=sub)  # varargs take anything
    assert torch.equal(sch.mod(X), expected)


# ----- the RNG tracker ---------------------------------------------------------------------------------
def test_rng_tracker_refuses_a_duplicate_stream_name_or_seed():
    tracker = RNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(ConfigError, match=r"RNG stream 'a' already exists"):
        tracker.add("a", 2)
    with pytest.raises(ConfigError, match=r"RNG seed 1 is already used by a stream"):
        tracker.add("b", 1)
    tracker.add("b", 2)
    tracker.reset()
    tracker.add("a", 1)  # a reset tracker starts afresh
    saved, generator = get_rng_tracker().get_states(), torch.get_rng_state()
    try:
        seed(1234)
        seed(1234)  # seeding again starts from a reset tracker
        assert get_rng_tracker().is_seeded()
    finally:
        get_rng_tracker().set_states(saved)
        torch.set_rng_state(generator)


def test_a_fork_inside_a_fork_keeps_drawing_and_a_reset_inside_one_stands():
    tracker = RNGStatesTracker()
    tracker.add("mp", 7)
    generator = torch.get_rng_state()
    try:
        with tracker.fork("mp"):
            outer = torch.rand(3)
            with tracker.fork("mp"):  # swapping the stored state in again would replay `outer`
                inner = torch.rand(3)
        assert not torch.equal(outer, inner)
        with tracker.fork("mp"):
            tracker.reset()  # e.g. seed() inside a fork: the fork must not write the old stream back
        assert not tracker.is_seeded("mp")
        tracker.add("mp", 7)
        with tracker.fork("mp"):
            again = torch.rand(6)
        assert torch.equal(again, torch.cat([outer, inner]))  # one stream, drawn in order
    finally:
        torch.set_rng_state(generator)
