"""Token sampling from the logits of one iteration."""

from __future__ import annotations

import torch

from iterserve.engine.sampling_params import SamplingParams


class Sampler:
    """Greedy (temperature 0) or temperature sampling, one row per request.

    Args:
        seed: seed of the generator used for every non-greedy row.
    """

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams]) -> list[int]:
        """logits: [num_reqs, vocab_size] float32 -> one token id per row."""
        tokens = logits.argmax(dim=-1)  # [num_reqs]
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = torch.tensor(random_rows)
            temps = torch.tensor([params[i].temperature for i in random_rows], dtype=torch.float32)
            probs = torch.softmax(logits[rows] / temps[:, None], dim=-1)  # [num_random, vocab]
            sampled = torch.multinomial(probs.cpu(), 1, generator=self.generator).squeeze(1)
            tokens[rows] = sampled.to(tokens.device)
        return tokens.tolist()
