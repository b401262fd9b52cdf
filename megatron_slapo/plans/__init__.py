"""Tensor-parallel plans: placements as data, applied to a schedule by the primitives.

- :mod:`.styles`: the placement styles (``ColumnParallel``, ``RowParallel``, the vocabulary-parallel
  ends, head-local attention, ...) and :func:`~.styles.apply_plan`;
- :mod:`.hf_plan`: reading the plan transformers publishes for a model (``base_model_tp_plan``);
  :mod:`.latent_attention`, DeepSeek's multi-head latent attention, which those plans leave out;
- :mod:`.sequence`: Megatron's sequence parallelism, and :func:`~.sequence.plan_schedule`, the
  ``apply`` of a schedule that is one plan;
- :mod:`.experts`, :mod:`.channels`, :mod:`.sync_batchnorm`: MoE blocks, convolution channels and
  the synchronised BatchNorm;
- :mod:`.fusion`, :mod:`.kernel_swap`: the passes that compute projections as one GEMM and swap in
  drop-in kernels.
"""
