"""Least-KV-pressure router (no torch, no engine). Implemented in a later issue."""
