"""Model definitions (Llama family) and model file loading."""
