"""Greedy picks the argmax; temperature sampling follows softmax(logits / T)."""

from __future__ import annotations

import torch

from iterserve.engine.sampling_params import SamplingParams
from iterserve.executor.sampler import Sampler


def test_greedy_is_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.9], [5.0, -1.0, 4.0]])
    assert Sampler(0)(logits, [SamplingParams(temperature=0.0)] * 2) == [1, 0]


def test_temperature_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1, 1e-9]))
    num = 4000
    params = [SamplingParams(temperature=1.0)] * num
    tokens = Sampler(1234)(logits.expand(num, 4).clone(), params)
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / num
    torch.testing.assert_close(freq, torch.tensor([0.6, 0.3, 0.1, 0.0]), atol=0.03, rtol=0)
    # Temperature 0.5 sharpens: p ~ p^2 normalised = [0.78, 0.2, 0.02].
    tokens = Sampler(99)(logits.expand(num, 4).clone(), [SamplingParams(temperature=0.5)] * num)
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / num
    expected = torch.tensor([0.36, 0.09, 0.01, 0.0]) / 0.46
    torch.testing.assert_close(freq, expected, atol=0.03, rtol=0)


def test_mixed_batch_keeps_greedy_rows_greedy() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0) for i in range(8)]
    tokens = Sampler(0)(logits.clone(), params)
    for i in range(1, 8, 2):
        assert tokens[i] == int(logits[i].argmax())
