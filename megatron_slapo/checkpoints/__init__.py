"""Checkpoints: Megatron's ``torch_dist`` and legacy ``torch`` formats written atomically and read
back at any layout (``checkpointing.py`` is the front, ``dist_checkpoint.py`` the sharded format,
``checkpoint_files.py`` the directory layout, ``checkpoint_integrity.py`` the checksums), RNG
states, HF weights to start from (``pretrained.py``) and conversions to and from HF
(``conversion.py``)."""
