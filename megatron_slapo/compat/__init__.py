"""Every use of a third-party private name or patch, in one place, each with the versions it was written against.

One module per library: ``torch_nn`` (``nn.Module``'s tensor, child and hook tables, torch's layer
bases), ``torch_internals`` (tensor, storage, operator, dispatch and profiler internals), ``dynamo``,
``fx`` (``MetaTracer``), ``distributed`` (c10d's group registry, the fake backend, collectives
wrapped), ``megatron_cpu`` (megatron-core on a CPU-only torch), ``megatron_internals`` (its process
groups), ``transformers_internals``, ``deepspeed_internals``, ``argparse_internals``. ``versions``
holds the supported version ranges, the versions tested, and the check that ``import megatron_slapo``
runs (refusing a version outside the ranges). Nothing else in the library, ``schedules/``,
``tools/`` or ``pretrain_*.py`` uses another package's private name (tests/test_compat.py lists any
that does; the tests themselves may).

This is the lowest layer: it imports third-party packages and the standard library, nothing of ours.
"""
