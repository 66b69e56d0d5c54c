"""The sampler's batched masks, penalties, draws and logprobs (one host transfer each) give
every row what it gets sampled alone: seeded rows the same tokens, logprobs the same values."""

from __future__ import annotations

import torch

from iterserve.engine.sampling_params import SamplingParams
from iterserve.executor.sampler import Sampler
from iterserve.kernels.platform import TorchPlatform

PARAMS = [
    SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=3, min_tokens=2),
    SamplingParams(temperature=0.7, top_p=0.8, seed=7, frequency_penalty=0.5, logprobs=0),
    SamplingParams(temperature=1.0, top_k=5, min_p=0.1, seed=11, presence_penalty=-0.4),
    SamplingParams(temperature=0.0, stop_token_ids=(4, 9), min_tokens=3, logprobs=5),
    SamplingParams(temperature=0.9, seed=3, repetition_penalty=0.8, logprobs=2),
]


def test_batched_rows_sample_as_they_do_alone() -> None:
    gen = torch.Generator().manual_seed(0)
    steps = [torch.randn(len(PARAMS), 300, generator=gen) * 3 for _ in range(4)]
    prompt = [5, 6, 7, 5]
    batched = Sampler(0, TorchPlatform(), frozenset({1, 2}))
    states = [batched.new_state(p, prompt) for p in PARAMS]
    together = [batched(logits.clone(), states) for logits in steps]
    for i, params in enumerate(PARAMS):
        alone = Sampler(0, TorchPlatform(), frozenset({1, 2}))
        state = [alone.new_state(params, prompt)]
        for step, logits in enumerate(steps):
            out = alone(logits[i : i + 1].clone(), state)
            assert out.token_ids == [together[step].token_ids[i]], (i, step)
            assert out.logprobs == [together[step].logprobs[i]], (i, step)
    assert all(lp is not None for lp in together[0].logprobs[:2])
    assert together[0].logprobs[0] is not None and len(together[0].logprobs[0].top) == 3
