"""Kernels with their torch references: C kernels for CPUs (built at first use), the plain
torch decode attention, oneDNN-packed linears, and the platform that chooses among them once
at start (:mod:`iterserve.kernels.platform`), and the Triton kernels (ragged paged attention,
KV-cache write) with their checks."""
