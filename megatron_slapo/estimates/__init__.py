"""What a layout will cost before it runs: ``tools/explain.py`` and the tuner plan a run on the meta
device (``estimate.py``) and count each rank's bytes, collectives and FLOPs, with expert and context
parallelism's share in ``expert_estimate.py`` and ``context_estimate.py``. It sits beside
``training/`` rather than inside it: it plans a run (``training.plan``) but never trains one. What
a run measures of itself as it trains (its FLOPs, ``training/flops.py``; its step's memory,
``training/memory.py``) stays with the run, whose log line reports it."""
