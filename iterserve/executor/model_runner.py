"""The model runner: SchedulerOutput -> input tensors -> one forward -> sampled tokens."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from iterserve.engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from iterserve.engine.policy import PreemptionCosts
from iterserve.engine.sampling_params import SamplingParams
from iterserve.executor.attention import AttentionMetadata, KVCache, PagedAttention
from iterserve.executor.cuda_graphs import DecodeGraphs, StaticDecodeInputs
from iterserve.executor.sampler import Sampler, SamplingState
from iterserve.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class ModelInputs:
    """One iteration's flattened batch (requests reordered: decodes first)."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled] int64, row of each sampled request's last token
    sampled: list[ScheduledRequest]  # the requests with sample=True, in logits order


def prepare_inputs(
    scheduled: list[ScheduledRequest], block_size: int, device: torch.device | None = None
) -> ModelInputs:
    """Flatten the scheduled requests into the model's inputs and attention metadata."""
    # Single-token queries first: the attention backend batches them as decodes.
    order = [s for s in scheduled if s.num_scheduled_tokens == 1]
    num_decodes = len(order)
    order += [s for s in scheduled if s.num_scheduled_tokens != 1]

    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    query_start_loc = [0]
    logits_indices: list[int] = []
    sampled: list[ScheduledRequest] = []
    max_num_blocks = max(len(s.block_table) for s in order)
    block_tables = torch.zeros(len(order), max_num_blocks, dtype=torch.int64)
    for i, s in enumerate(order):
        start, end = s.num_computed_tokens, s.seq_len
        input_ids.extend(s.token_ids)
        positions.extend(range(start, end))
        table = s.block_table
        slot_mapping.extend(
            table[p // block_size] * block_size + p % block_size for p in range(start, end)
        )
        block_tables[i, : len(table)] = torch.tensor(table, dtype=torch.int64)
        query_start_loc.append(query_start_loc[-1] + s.num_scheduled_tokens)
        if s.sample:
            logits_indices.append(query_start_loc[-1] - 1)
            sampled.append(s)
    seq_lens = [s.seq_len for s in order]
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int64, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        block_tables=block_tables.to(device),
        num_decodes=num_decodes,
        query_lens=[s.num_scheduled_tokens for s in order],
        seq_lens_list=seq_lens,
    )
    return ModelInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        metadata=metadata,
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=device),
        sampled=sampled,
    )


class TorchModelRunner:
    """Runs a :class:`LlamaForCausalLM` over a paged :class:`KVCache` (implements the engine's
    ``ModelRunner`` protocol). Keeps each request's sampling state (generator, token history)
    until the scheduler reports the request finished.

    The model's platform (chosen once at start, see
    :func:`~iterserve.kernels.platform.select_platform`) is the one the attention and the
    sampler run on: the C kernels come as a set or not at all.

    Args:
        model: the loaded model, in its serving dtype, on ``device``, built on its platform.
        kv_cache: the KV cache tensors (with their host swap pool).
        seed: seed of the sampler's shared generator.
        eos_token_ids: masked until a request's ``min_tokens``.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        seed: int,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = model.embed_tokens.weight.device
        self.platform = model.platform
        self.sampler = Sampler(seed, self.platform, eos_token_ids)
        self.scale = float(model.head_dim) ** -0.5
        self.states: dict[str, SamplingState] = {}
        # Padded decode in static buffers (CUDA graphs once captured), if enabled.
        self.decode_graphs: DecodeGraphs | None = None
        self.is_driver = model.tp.is_driver

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Make the output's block copies, run the forward of its scheduled requests and
        sample (the driver, or the only rank); a tensor-parallel worker rank returns no
        tokens."""
        for request_id in scheduler_output.finished_request_ids:
            self.states.pop(request_id, None)
        self.kv_cache.swap_out(scheduler_output.blocks_to_swap_out)
        self.kv_cache.swap_in(scheduler_output.blocks_to_swap_in)
        if scheduler_output.is_empty:
            return ModelRunnerOutput(sampled_token_ids={})
        scheduled = scheduler_output.scheduled
        graphs = self.decode_graphs
        bucket = graphs.bucket_for(scheduled) if graphs is not None else None
        logits: torch.Tensor | None
        if graphs is not None and bucket is not None:
            logits = graphs.run(scheduled, bucket)  # [num_reqs, vocab], padding dropped
            sampled = scheduled
        else:
            inputs = prepare_inputs(scheduled, self.kv_cache.block_size, self.device)
            attention = PagedAttention(self.kv_cache, inputs.metadata, self.scale, self.platform)
            hidden = self.model(inputs.input_ids, inputs.positions, attention)  # [tokens, hidden]
            if not inputs.sampled:
                return ModelRunnerOutput(sampled_token_ids={})
            logits = self.model.compute_logits(hidden[inputs.logits_indices])  # [sampled, vocab]
            sampled = inputs.sampled
        if logits is None:  # a tensor-parallel worker: the driver samples
            return ModelRunnerOutput(sampled_token_ids={})
        states = [self._state(s) for s in sampled]
        out = self.sampler(logits, states)
        ids = [s.request_id for s in sampled]
        return ModelRunnerOutput(
            sampled_token_ids=dict(zip(ids, out.token_ids, strict=True)),
            logprobs={i: lp for i, lp in zip(ids, out.logprobs, strict=True) if lp is not None},
        )

    def enable_padded_decode(self, buckets: list[int], max_model_len: int) -> DecodeGraphs:
        """Run pure-decode iterations of at most ``buckets[-1]`` requests padded to a bucket in
        static buffers (eagerly until :meth:`capture_decode_graphs`); see
        :mod:`~iterserve.executor.cuda_graphs`."""
        kv = self.kv_cache
        inputs = StaticDecodeInputs(
            buckets[-1], max_model_len, kv.block_size, kv.num_blocks, self.device
        )
        self.decode_graphs = DecodeGraphs(inputs, buckets, self._decode_logits)
        return self.decode_graphs

    @torch.inference_mode()
    def capture_decode_graphs(self) -> None:
        """Capture the padded decode forward of every bucket as a CUDA graph (CUDA only).

        Raises:
            RuntimeError: :meth:`enable_padded_decode` was not called, the platform has no
                :meth:`~iterserve.kernels.platform.Platform.static_decode_attention`, or
                capture failed.
        """
        if self.decode_graphs is None:
            raise RuntimeError("enable_padded_decode first")
        inputs = self.decode_graphs.inputs
        probe = self.platform.static_decode_attention(
            inputs.block_tables, inputs.seq_lens, inputs.query_start_loc, inputs.max_model_len, 1.0
        )
        if (
            probe is None
        ):  # its decode attention reads host lengths: a graph would replay stale ones
            raise RuntimeError(
                f"the {self.platform.name} platform has no graph-safe decode attention: CUDA "
                f"graphs need the triton one (or pass --enforce-eager)"
            )
        self.decode_graphs.capture()

    def _decode_logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """The forward and LM head over every row of a padded decode batch -> [rows, vocab]."""
        attention = PagedAttention(self.kv_cache, metadata, self.scale, self.platform)
        logits = self.model.compute_logits(self.model(input_ids, positions, attention))
        assert logits is not None, "padded decode runs with one rank only"
        return logits

    def _state(self, sched: ScheduledRequest) -> SamplingState:
        state = self.states.get(sched.request_id)
        if state is None:
            state = self.sampler.new_state(sched.sampling_params, sched.prompt_token_ids)
            self.states[sched.request_id] = state
        return state

    @torch.inference_mode()
    def measure_preemption_costs(
        self,
        num_tokens: int = 256,
        execute: Callable[[SchedulerOutput], ModelRunnerOutput] | None = None,
    ) -> PreemptionCosts:
        """Time one prefill of ``num_tokens`` and a swap of as many tokens' blocks (start-up).

        Args:
            num_tokens: tokens of the timed prefill (at most the KV pool's).
            execute: runs the prefill (default :meth:`execute_model`; a tensor-parallel
                replica's runner passes its own, so that every rank runs it).
        """
        execute = execute or self.execute_model
        bs = self.kv_cache.block_size
        num_blocks = min(-(-num_tokens // bs), self.kv_cache.num_blocks)
        num_tokens = min(num_tokens, num_blocks * bs)
        token_ids = [i % self.model.config.vocab_size for i in range(num_tokens)]
        sched = ScheduledRequest(
            "profile", token_ids, 0, list(range(num_blocks)), False, SamplingParams()
        )
        execute(SchedulerOutput(scheduled=[sched]))  # warm-up
        self._synchronize()
        start = time.perf_counter()
        execute(SchedulerOutput(scheduled=[sched]))
        self._synchronize()  # nothing is sampled: the forward may still run on a GPU
        prefill_s = (time.perf_counter() - start) / num_tokens
        kv_bytes_per_token = self.kv_cache.bytes_per_token
        if self.kv_cache.num_host_blocks == 0:
            return PreemptionCosts(prefill_s, float("inf"), kv_bytes_per_token)
        pairs = [(i, i) for i in range(min(num_blocks, self.kv_cache.num_host_blocks))]
        start = time.perf_counter()
        self.kv_cache.swap_out(pairs)
        self.kv_cache.swap_in(pairs)
        self.kv_cache.synchronize()
        elapsed = max(time.perf_counter() - start, 1e-9)
        bandwidth = 2 * len(pairs) * bs * kv_bytes_per_token / elapsed
        return PreemptionCosts(prefill_s, bandwidth, kv_bytes_per_token)

    def _synchronize(self) -> None:
        """Wait for the device's queued work (timing only; nothing on a CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
