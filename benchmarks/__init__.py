"""One-off benchmark studies, run from a checkout (``python -m benchmarks.<name>`` from the
repository root); not installed. Their conclusions live in docs/benchmarks.md,
docs/reliability.md and docs/gpu.md."""
