"""Kernels with their torch references: C kernels for CPUs (built at first use), the plain
torch decode attention, oneDNN-packed linears, and the platform that chooses among them once
at start (:mod:`iterserve.kernels.platform`; Triton kernels arrive with a GPU platform)."""
