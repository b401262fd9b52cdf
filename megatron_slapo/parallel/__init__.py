"""The parallel runtime: process groups and this rank's Layout, autograd collectives, RNG streams, the
comm log and the shard layout. Plans that use it live in :mod:`megatron_slapo.plans`."""

from megatron_slapo.parallel.random import get_rng_tracker, seed
from megatron_slapo.parallel.state import default_group, destroy, initialize, simulate, tensor_parallel_group

__all__ = ["initialize", "simulate", "destroy", "default_group", "tensor_parallel_group", "get_rng_tracker", "seed"]
