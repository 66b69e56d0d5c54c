"""Token sampling from the logits of one iteration, one row per request.

Order of processing (as vLLM): min_tokens mask -> repetition/presence/frequency penalties ->
greedy argmax, or temperature -> min_p -> top_k / top_p -> a draw. Draws use the exponential
race (argmax of p / q with q ~ Exp(1) is a sample from p), so each request can use its own
seeded generator, making seeded sampling independent of what else is batched. Logprobs are
those of the raw model distribution (before any processing), as vLLM reports them.

Everything runs on the logits' device: generators live there (created on the first draw, so a
seed gives the same tokens on one device type, CPU or CUDA, but not across them), per-request
masks and penalties go over in one host-to-device copy each, and the host reads only the
sampled ids and, when asked, the logprobs (one transfer each per iteration).
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
    # The request's own generator (seeded requests), on the logits' device from the first draw.
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
        self.seed = seed
        # The shared generator per device (created on the first draw there, seeded with seed).
        self.generators: dict[torch.device, torch.Generator] = {}
        self.platform = platform
        self.eos_token_ids = sorted(eos_token_ids)

    def new_state(self, params: SamplingParams, prompt_token_ids: list[int]) -> SamplingState:
        return SamplingState(params, prompt_token_ids)

    def __call__(self, logits: torch.Tensor, states: list[SamplingState]) -> SamplerOutput:
        """logits: [num_reqs, vocab_size] in the model's dtype (float32 logits are modified
        in place) -> tokens and logprobs. Everything but a plain greedy batch works on a
        float32 copy; a plain greedy batch is one :meth:`Platform.argmax_rows` over the logits
        as they are (the C kernel reads bfloat16 directly: a float32 copy and torch's argmax
        cost 3-5 ms at 128 x 49,152 on the development CPU)."""
        if all(self._plain_greedy(s, logits.shape[1]) for s in states):
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
            lp_rows = [i for i, want in enumerate(want_logprobs) if want]
            for i, lp in zip(
                lp_rows,
                _token_logprobs(raw_logprobs, tokens, token_list, lp_rows, states),
                strict=True,
            ):
                logprobs[i] = lp
        return SamplerOutput(token_list, logprobs)

    def _plain_greedy(self, s: SamplingState, vocab_size: int) -> bool:
        """Greedy with nothing that changes or reports the distribution this iteration (a
        ``min_tokens`` window whose mask is empty, as ``ignore_eos`` without stop ids, keeps
        the plain path: a float32 copy of [32, 49,152] costs more than its argmax)."""
        p = s.params
        return (
            p.greedy
            and p.logprobs is None
            and not p.needs_penalties
            and not self._masked_ids(s, vocab_size)
        )

    def _masked_ids(self, s: SamplingState, vocab_size: int) -> list[int]:
        """The token ids masked for ``s`` this iteration: its stop ids and (without
        ``ignore_eos``) the EOS ids while fewer than ``min_tokens`` are out."""
        if len(s.output_token_ids) >= s.params.min_tokens:
            return []
        ids = list(s.params.stop_token_ids)
        if not s.params.ignore_eos:
            ids += self.eos_token_ids
        return [t for t in ids if t < vocab_size]

    def _mask_until_min_tokens(self, logits: torch.Tensor, states: list[SamplingState]) -> None:
        rows: list[int] = []
        cols: list[int] = []
        for i, s in enumerate(states):
            ids = self._masked_ids(s, logits.shape[1])
            rows += [i] * len(ids)
            cols += ids
        if rows:
            index = torch.tensor([rows, cols], dtype=torch.int64).to(logits.device)
            logits[index[0], index[1]] = float("-inf")

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, states: list[SamplingState]) -> None:
        """Repetition (prompt and output tokens), frequency and presence penalties (output
        tokens) of the rows that have any, in one batch: token counts come over as one
        index list."""
        rows = [i for i, s in enumerate(states) if s.params.needs_penalties]
        if not rows:
            return
        vocab, device, dtype = logits.shape[1], logits.device, logits.dtype
        out_rows = [j for j, i in enumerate(rows) for _ in states[i].output_token_ids]
        out_ids = [t for i in rows for t in states[i].output_token_ids]
        rep_rows = [j for j, i in enumerate(rows) if states[i].params.repetition_penalty != 1.0]
        prompt_rows = [j for j in rep_rows for _ in states[rows[j]].prompt_token_ids]
        prompt_ids = [t for j in rep_rows for t in states[rows[j]].prompt_token_ids]
        params = [states[i].params for i in rows]
        host = torch.tensor([out_rows + prompt_rows, out_ids + prompt_ids], dtype=torch.int64).to(
            device
        )
        scalars = torch.tensor(
            [
                [p.repetition_penalty for p in params],
                [p.frequency_penalty for p in params],
                [p.presence_penalty for p in params],
            ],
            dtype=dtype,
        ).to(device)[:, :, None]  # [3, num_rows, 1]
        rep, freq, presence = scalars[0], scalars[1], scalars[2]
        n_out = len(out_ids)
        counts = torch.zeros(len(rows), vocab, dtype=dtype, device=device)
        counts.index_put_(
            (host[0, :n_out], host[1, :n_out]),
            torch.ones(n_out, dtype=dtype, device=device),
            accumulate=True,
        )
        index = torch.tensor(rows, dtype=torch.int64).to(device)
        sub = logits[index]  # [num_rows, vocab]
        if rep_rows:
            seen = counts > 0
            seen[host[0, n_out:], host[1, n_out:]] = True
            # x / 1.0 and x * 1.0 are x: rows without a repetition penalty are unchanged.
            penalized = torch.where(sub > 0, sub / rep, sub * rep)
            sub = torch.where(seen, penalized, sub)
        sub = sub - freq * counts
        sub = sub - presence * (counts > 0).to(dtype)
        logits[index] = sub

    @staticmethod
    def _probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """[num_random, vocab] logits -> truncated, renormalised probabilities."""
        temps = torch.tensor(
            [p.temperature for p in params], dtype=logits.dtype, device=logits.device
        )
        probs = torch.softmax(logits / temps[:, None], dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype).to(probs.device)
            threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        if any(p.uses_top_k or p.top_p < 1.0 for p in params):
            probs = _top_k_top_p(probs, params)
        return probs / probs.sum(dim=-1, keepdim=True)

    def _draw(self, probs: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Exponential race on the probabilities' device: the shared generator's noise for
        the rows without a seed (one draw), each seeded request's own for its row."""
        device = probs.device
        q = torch.empty_like(probs)
        shared = [i for i, s in enumerate(states) if s.params.seed is None]
        if shared:
            gen = self.generators.get(device)
            if gen is None:
                gen = torch.Generator(device).manual_seed(self.seed)
                self.generators[device] = gen
            noise = torch.empty(len(shared), probs.shape[1], device=device)
            q[torch.tensor(shared).to(device)] = noise.exponential_(generator=gen)
        for i, s in enumerate(states):
            if s.params.seed is not None:
                if s.generator is None or s.generator.device != device:
                    s.generator = torch.Generator(device).manual_seed(s.params.seed)
                q[i] = torch.empty(probs.shape[1], device=device).exponential_(
                    generator=s.generator
                )
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


def _token_logprobs(
    raw: torch.Tensor,
    tokens: torch.Tensor,
    token_list: list[int],
    rows: list[int],
    states: list[SamplingState],
) -> list[TokenLogprobs]:
    """The sampled token's logprob and each row's top ``params.logprobs`` for ``rows``.

    Args:
        raw: [num_reqs, vocab] raw log-probabilities.
        tokens: [num_reqs] int64, the sampled ids (on raw's device); token_list the same
            on the host.
        rows: the rows that asked for logprobs.

    One transfer to the host: the chosen logprobs and every top-k (one ``topk`` per distinct
    k) are concatenated on the device first.
    """
    index = torch.tensor(rows, dtype=torch.int64).to(raw.device)
    parts = [raw[index, tokens[index]]]  # [len(rows)]
    by_k: dict[int, list[int]] = {}
    for j, i in enumerate(rows):
        k = states[i].params.logprobs or 0
        if k:
            by_k.setdefault(k, []).append(j)
    for k, js in by_k.items():
        values, ids = raw[index[torch.tensor(js).to(raw.device)]].topk(k)  # [len(js), k]
        # ids as float32 are exact below 2**24 (vocabularies are far smaller)
        parts += [values.flatten(), ids.flatten().to(raw.dtype)]
    flat = torch.cat(parts).tolist()
    chosen, offset = flat[: len(rows)], len(rows)
    top: dict[int, list[tuple[int, float]]] = {}
    for k, js in by_k.items():
        n = len(js) * k
        top_values, top_ids = flat[offset : offset + n], flat[offset + n : offset + 2 * n]
        offset += 2 * n
        for r, j in enumerate(js):
            row = slice(r * k, (r + 1) * k)
            top[j] = [(int(t), v) for t, v in zip(top_ids[row], top_values[row], strict=True)]
    return [
        TokenLogprobs(token_id=token_list[i], logprob=chosen[j], top=top.get(j, []))
        for j, i in enumerate(rows)
    ]
