"""Engine core: requests, sampling params, block pool/manager, scheduler (no torch)."""
