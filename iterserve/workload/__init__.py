"""Seeded request workloads, the JSONL trace format and serving statistics (percentiles,
goodput, the latency gate): shared by the simulator, telemetry reports and the benchmarks."""
