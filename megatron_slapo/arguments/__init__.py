"""The flags of a run: Megatron-LM's argument parser and ours (``parser.py``), their validation
(one line naming every problem, ``validation.py``), the model config they describe
(``config_from_flags.py``, ``widths.py``) and the output paths they name. Nothing here builds a
model or starts a process group: explain, the tuner and the trainer all read flags through it."""
