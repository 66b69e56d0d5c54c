"""The sampler on hand-made logits: every processing step against its definition."""

from __future__ import annotations

import math

import pytest
import torch

from iterserve.engine.sampling_params import SamplingParams
from iterserve.executor.sampler import Sampler, SamplingState
from iterserve.kernels.platform import CpuKernelsPlatform, Platform, TorchPlatform

EOS = 3
TORCH = TorchPlatform()


def states(*params: SamplingParams, prompt: list[int] | None = None) -> list[SamplingState]:
    sampler = Sampler(0, TORCH)
    return [sampler.new_state(p, prompt or []) for p in params]


def frequencies(
    logits: torch.Tensor, params: SamplingParams, num: int = 4000, seed: int = 1
) -> torch.Tensor:
    vocab = logits.shape[-1]
    tokens = Sampler(seed, TORCH)(
        logits.expand(num, vocab).clone(), states(*[params] * num)
    ).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=vocab).float() / num


@pytest.mark.parametrize(
    "platform", [TORCH, CpuKernelsPlatform(pack_weights=False)], ids=["torch", "cpu"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_greedy_is_argmax(platform: Platform, dtype: torch.dtype) -> None:
    logits = torch.tensor([[0.1, 3.0, 2.9], [5.0, -1.0, 4.0], [1.0, 7.0, 7.0]], dtype=dtype)
    greedy = SamplingParams(temperature=0.0)
    out = Sampler(0, platform)(logits, states(greedy, greedy, greedy))
    assert out.token_ids == [1, 0, 1]  # a tie: the first index


def test_temperature_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1, 1e-9]))
    freq = frequencies(logits, SamplingParams(temperature=1.0))
    torch.testing.assert_close(freq, torch.tensor([0.6, 0.3, 0.1, 0.0]), atol=0.03, rtol=0)
    # Temperature 0.5 squares the probabilities (renormalised).
    freq = frequencies(logits, SamplingParams(temperature=0.5), seed=2)
    expected = torch.tensor([0.36, 0.09, 0.01, 0.0]) / 0.46
    torch.testing.assert_close(freq, expected, atol=0.03, rtol=0)


def test_top_k_top_p_min_p_truncate() -> None:
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    freq = frequencies(logits, SamplingParams(top_k=2))
    torch.testing.assert_close(freq, torch.tensor([4 / 7, 3 / 7, 0, 0]), atol=0.03, rtol=0)
    # top_p 0.75: 0.4 + 0.3 < 0.75, so the 0.2 token is still needed; 0.1 is not.
    freq = frequencies(logits, SamplingParams(top_p=0.75))
    torch.testing.assert_close(freq, torch.tensor([4, 3, 2, 0]) / 9, atol=0.03, rtol=0)
    # min_p 0.6: keep tokens with p >= 0.6 * 0.4 = 0.24.
    freq = frequencies(logits, SamplingParams(min_p=0.6))
    torch.testing.assert_close(freq, torch.tensor([4 / 7, 3 / 7, 0, 0]), atol=0.03, rtol=0)
    # top_k = 1 is greedy whatever the temperature.
    assert frequencies(logits, SamplingParams(top_k=1, temperature=5.0), num=200)[0] == 1.0


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 100, generator=gen)
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = [Sampler(0, TORCH)(logits[:1].clone(), states(seeded)).token_ids[0] for _ in range(3)]
    assert len(set(alone)) == 1
    mixed = states(SamplingParams(), seeded, SamplingParams(seed=7), SamplingParams())
    busy = Sampler(123, TORCH)(torch.cat([logits[3:4], logits[:1], logits[4:6]]).clone(), mixed)
    assert busy.token_ids[1] == alone[0]

    # A sequence of draws with one seed repeats; another seed differs somewhere.
    def run(seed: int) -> list[int]:
        state = states(SamplingParams(seed=seed))
        sampler = Sampler(0, TORCH)
        return [sampler(logits[i : i + 1].clone(), state).token_ids[0] for i in range(6)]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_penalties() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
    state = states(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=[1])
    state[0].output_token_ids.extend([0])
    out = logits.clone()
    Sampler._apply_penalties(out, state)
    # Seen tokens 0 (output) and 1 (prompt): positive logits divided, negative multiplied.
    torch.testing.assert_close(out, torch.tensor([[1.0, -2.0, 0.5, 1.0]]))
    state = states(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
    state[0].output_token_ids.extend([2, 2, 3])
    out = logits.clone()
    Sampler._apply_penalties(out, state)
    torch.testing.assert_close(out, torch.tensor([[2.0, -1.0, 0.5 - 0.5 - 0.5, 1.0 - 0.5 - 0.25]]))


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.tensor([[0.0, 0.0, 1.0, 9.0, 8.0]])
    sampler = Sampler(0, TORCH, eos_token_ids=frozenset({EOS}))
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(4,))
    state = [sampler.new_state(params, [])]
    assert sampler(logits.clone(), state).token_ids == [2]
    assert sampler(logits.clone(), state).token_ids == [2]
    assert sampler(logits.clone(), state).token_ids == [EOS]  # two tokens out: unmasked


class CountingPlatform(TorchPlatform):
    """Counts the plain greedy batches it is asked to argmax."""

    calls = 0

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        CountingPlatform.calls += 1
        return super().argmax_rows(logits)


def test_a_min_tokens_window_that_masks_nothing_stays_plain_greedy() -> None:
    # bench serve's requests: ignore_eos with min_tokens = max_tokens, no stop ids. Nothing is
    # masked, so the batch needs no float32 copy: the platform's argmax (the C kernel on CPUs).
    logits = torch.tensor([[0.0, 0.0, 1.0, 9.0, 8.0]], dtype=torch.bfloat16)
    sampler = Sampler(0, CountingPlatform(), eos_token_ids=frozenset({EOS}))
    CountingPlatform.calls = 0
    unmasked = SamplingParams(temperature=0.0, min_tokens=4, ignore_eos=True)
    assert sampler(logits.clone(), [sampler.new_state(unmasked, [])]).token_ids == [EOS]
    assert CountingPlatform.calls == 1
    # A window with something to mask still masks it, on the float32 path.
    for params in (
        SamplingParams(temperature=0.0, min_tokens=4),
        SamplingParams(temperature=0.0, min_tokens=4, ignore_eos=True, stop_token_ids=(EOS,)),
    ):
        assert sampler(logits.clone(), [sampler.new_state(params, [])]).token_ids == [4]
    assert CountingPlatform.calls == 1


def test_logprobs_are_the_raw_distribution() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    out = Sampler(0, TORCH)(logits.clone(), states(SamplingParams(temperature=0.0, logprobs=2)))
    lp = out.logprobs[0]
    assert lp is not None
    expected = torch.log_softmax(logits[0], dim=-1)
    assert lp.token_id == 2
    assert math.isclose(lp.logprob, float(expected[2]), rel_tol=1e-6)
    assert [t for t, _ in lp.top] == [2, 1]
    assert math.isclose(lp.top[1][1], float(expected[1]), rel_tol=1e-6)
    none = Sampler(0, TORCH)(logits.clone(), states(SamplingParams(temperature=0.0)))
    assert none.logprobs == [None]
