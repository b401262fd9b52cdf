"""Replacement modules that schedules splice in: fused QKV, compiled subgraphs, decomposed linears,
attention on an explicit SDPA kernel."""
