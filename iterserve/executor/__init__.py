"""Model execution: input preparation, attention metadata, KV cache tensors, sampling (torch)."""
