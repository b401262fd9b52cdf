"""The trainer: arguments, model, tasks, loop, checkpoints, reporting (``pretrain_*.py`` call :func:`loop.pretrain`)."""
