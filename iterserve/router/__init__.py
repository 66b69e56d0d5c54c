"""Least-KV-pressure router (no torch, no engine; docs/router.md)."""
