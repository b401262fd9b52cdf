"""The run: its settings, the model and task it trains, planning it (``plan.py``), setting it up
(``run.py``) and the loop (``loop.py``: ``pretrain_*.py`` call :func:`loop.main`), with its
reporting. Flags live in ``arguments/``, checkpoints in ``checkpoints/``, explain's estimates in
``estimates/``."""
