"""Sharded checkpoint files: one directory per step, written by every rank and verified on load.

``sharded_files`` (the index, the rank files, the agreement that a step is complete),
``step_dirs`` (staging, the atomic rename into place, ``latest``) and ``safe_files`` (bounded,
regular-file-only reads). What a model or optimizer puts into them is ``torch_side.fsdp``'s
(``sharded_state``); the training loop's checkpoint is ``apps.training.checkpoint``.
"""
