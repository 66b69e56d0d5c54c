"""Triton kernels with their torch reference implementations (first kernels arrive with the
Triton attention backend)."""
