"""Token sampling from the logits of one iteration, one row per request.

Order of processing (as vLLM): min_tokens mask -> repetition/presence/frequency penalties ->
greedy argmax, or temperature -> min_p -> top_k / top_p -> a draw. Draws use the exponential
race (argmax of p / q with q ~ Exp(1) is a sample from p), so each request can use its own
seeded generator, making seeded sampling independent of what else is batched. Logprobs are
those of the raw model distribution (before any processing), as vLLM reports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from iterserve.engine.outputs import TokenLogprobs
from iterserve.engine.sampling_params import SamplingParams
from iterserve.kernels.platform import Platform


@dataclass
class SamplingState:
    """What the sampler keeps per request between iterations."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    """Samples one token per row.

    Args:
        seed: seeds the generator shared by requests that have no seed of their own.
        platform: runs a plain greedy batch's row argmax (the C kernel on CPUs reads
            bfloat16 logits directly).
        eos_token_ids: masked (with ``stop_token_ids``) until ``min_tokens`` are out.
    """

    def __init__(
        self, seed: int, platform: Platform, eos_token_ids: frozenset[int] = frozenset()
    ) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.platform = platform
        self.eos_token_ids = sorted(eos_token_ids)

    def new_state(self, params: SamplingParams, prompt_token_ids: list[int]) -> SamplingState:
        gen = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        return SamplingState(params, prompt_token_ids, generator=gen)

    def __call__(self, logits: torch.Tensor, states: list[SamplingState]) -> SamplerOutput:
        """logits: [num_reqs, vocab_size] in the model's dtype (float32 logits are modified
        in place) -> tokens and logprobs. Everything but a plain greedy batch works on a
        float32 copy; a plain greedy batch is one :meth:`Platform.argmax_rows` over the logits
        as they are (the C kernel reads bfloat16 directly: a float32 copy and torch's argmax
        cost 3-5 ms at 128 x 49,152 on the development CPU)."""
        if all(self._plain_greedy(s) for s in states):
            tokens = self.platform.argmax_rows(logits)  # [num_reqs] int64
            token_list = tokens.tolist()
            for state, token in zip(states, token_list, strict=True):
                state.output_token_ids.append(token)
            return SamplerOutput(token_list, [None] * len(states))
        logits = logits.float()
        want_logprobs = [s.params.logprobs is not None for s in states]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        self._mask_until_min_tokens(logits, states)
        self._apply_penalties(logits, states)
        tokens = logits.argmax(dim=-1)  # [num_reqs]; kept for greedy rows
        random_rows = [i for i, s in enumerate(states) if not s.params.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            probs = self._probs(logits[rows], [states[i].params for i in random_rows])
            tokens[rows] = self._draw(probs, [states[i] for i in random_rows])
        token_list = tokens.tolist()
        for state, token in zip(states, token_list, strict=True):
            state.output_token_ids.append(token)
        logprobs: list[TokenLogprobs | None] = [None] * len(states)
        if raw_logprobs is not None:
            for i, state in enumerate(states):
                if want_logprobs[i]:
                    logprobs[i] = _token_logprobs(raw_logprobs[i], token_list[i], state.params)
        return SamplerOutput(token_list, logprobs)

    @staticmethod
    def _plain_greedy(s: SamplingState) -> bool:
        """Greedy with nothing that changes or reports the distribution this iteration."""
        p = s.params
        return (
            p.greedy
            and p.logprobs is None
            and not p.needs_penalties
            and len(s.output_token_ids) >= p.min_tokens
        )

    def _mask_until_min_tokens(self, logits: torch.Tensor, states: list[SamplingState]) -> None:
        for i, s in enumerate(states):
            if len(s.output_token_ids) < s.params.min_tokens:
                ids = list(s.params.stop_token_ids)
                if not s.params.ignore_eos:
                    ids += self.eos_token_ids
                ids = [t for t in ids if t < logits.shape[1]]
                if ids:
                    logits[i, ids] = float("-inf")

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, states: list[SamplingState]) -> None:
        vocab = logits.shape[1]
        for i, s in enumerate(states):
            p = s.params
            if not p.needs_penalties:
                continue
            out = torch.tensor(s.output_token_ids, dtype=torch.int64, device=logits.device)
            counts = torch.bincount(out, minlength=vocab).to(logits.dtype)  # [vocab]
            row = logits[i]
            if p.repetition_penalty != 1.0:
                prompt = torch.tensor(s.prompt_token_ids, dtype=torch.int64, device=logits.device)
                seen = counts > 0
                seen[prompt] = True
                penalized = torch.where(
                    row > 0, row / p.repetition_penalty, row * p.repetition_penalty
                )
                row.copy_(torch.where(seen, penalized, row))
            row -= p.frequency_penalty * counts
            row -= p.presence_penalty * (counts > 0).to(logits.dtype)

    @staticmethod
    def _probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """[num_random, vocab] logits -> truncated, renormalised probabilities."""
        temps = torch.tensor(
            [p.temperature for p in params], dtype=logits.dtype, device=logits.device
        )
        probs = torch.softmax(logits / temps[:, None], dim=-1)
        min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=probs.device)
        if bool((min_p > 0).any()):
            threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        if any(p.uses_top_k or p.top_p < 1.0 for p in params):
            probs = _top_k_top_p(probs, params)
        return probs / probs.sum(dim=-1, keepdim=True)

    def _draw(self, probs: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        q = torch.empty_like(probs)
        shared = [i for i, s in enumerate(states) if s.generator is None]
        if shared:
            q[shared] = (
                torch.empty(len(shared), probs.shape[1])
                .exponential_(generator=self.generator)
                .to(q.device)
            )
        for i, s in enumerate(states):
            if s.generator is not None:
                q[i] = torch.empty(probs.shape[1]).exponential_(generator=s.generator).to(q.device)
        return (probs / q).argmax(dim=-1)


def _top_k_top_p(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # [rows, vocab]
    vocab = probs.shape[1]
    ranks = torch.arange(vocab, device=probs.device)[None, :]
    top_k = torch.tensor(
        [min(p.top_k, vocab) if p.uses_top_k else vocab for p in params], device=probs.device
    )
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype, device=probs.device)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = (ranks < top_k[:, None]) & (mass_before < top_p[:, None])
    keep[:, 0] = True  # the best token always survives
    return torch.zeros_like(probs).scatter(1, order, sorted_probs * keep)


def _token_logprobs(row: torch.Tensor, token: int, params: SamplingParams) -> TokenLogprobs:
    """row: [vocab] raw log-probabilities."""
    k = params.logprobs or 0
    top: list[tuple[int, float]] = []
    if k:
        values, ids = row.topk(k)
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprobs(token_id=token, logprob=float(row[token]), top=top)
