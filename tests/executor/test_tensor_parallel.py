"""Tensor parallelism without processes: the per-step delta messages, the degrees a model
splits into, and shard loading (each rank's weights are the slice of the full weights, and a
rank reads only its shard). The multi-process runs are in test_tensor_parallel_parity.py and
tests/server/test_tensor_parallel_server.py."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig

from iterserve.config import ConfigError
from iterserve.engine.outputs import ScheduledRequest, SchedulerOutput
from iterserve.engine.sampling_params import SamplingParams
from iterserve.executor.tensor_parallel import TensorParallelError, TensorParallelRunner
from iterserve.executor.tp_messages import StepDecoder, StepEncoder
from iterserve.executor.weights import (
    check_tensor_parallel,
    checkpoint_slices,
    load_hf_config,
    load_model,
)
from iterserve.kernels.platform import select_platform
from iterserve.models.llama import LlamaForCausalLM
from iterserve.models.loader import resolve_model_dir
from iterserve.models.parallel import TPGroup, kv_head_range

PARAMS = SamplingParams(max_tokens=8, temperature=0.7, repetition_penalty=1.2)
PROMPT = list(range(100, 140))


def _sched(request_id: str, tokens: list[int], computed: int, table: list[int]) -> Any:
    return ScheduledRequest(request_id, tokens, computed, table, True, PARAMS, PROMPT)


def test_the_workers_rebuild_every_step_from_deltas() -> None:
    encoder, decoder = StepEncoder(), StepDecoder()
    steps = [
        SchedulerOutput([_sched("a", PROMPT[:32], 0, [4, 5])]),  # a prefill chunk
        SchedulerOutput([_sched("a", PROMPT[32:], 32, [4, 5, 6]), _sched("b", [7], 0, [9])]),
        SchedulerOutput([_sched("a", [11], 40, [4, 5, 6]), _sched("b", [8], 1, [9])]),
        # b preempted by recompute; a swapped out and back in to other blocks
        SchedulerOutput(
            [_sched("a", [12], 41, [1, 2, 3])],
            preempted_request_ids=["b"],
            blocks_to_swap_in=[(0, 1), (1, 2), (2, 3)],
        ),
        SchedulerOutput([_sched("b", [7, 8, 13], 0, [6])], finished_request_ids=["a"]),
    ]
    messages = []
    for out in steps:
        msg = pickle.loads(pickle.dumps(encoder.encode(out)))
        messages.append(msg)
        rebuilt = decoder.decode(msg)
        assert [
            (s.request_id, s.token_ids, s.num_computed_tokens, s.block_table, s.sample)
            for s in rebuilt.scheduled
        ] == [
            (s.request_id, s.token_ids, s.num_computed_tokens, s.block_table, s.sample)
            for s in out.scheduled
        ]
        assert rebuilt.blocks_to_swap_in == out.blocks_to_swap_in
        assert rebuilt.preempted_request_ids == out.preempted_request_ids
        assert rebuilt.finished_request_ids == out.finished_request_ids
        assert decoder.tables == encoder.tables  # the driver's mirror is the workers' state
    # Deltas: a decode step carries its token and no block; a grown table only the new block;
    # a preempted or moved request its table in full again; no prompt, no sampling params.
    decode = messages[2].scheduled
    assert [(d.token_ids, d.blocks, d.full_table) for d in decode] == [
        ([11], [], False),
        ([8], [], False),
    ]
    assert [(d.blocks, d.full_table) for d in messages[1].scheduled] == [([6], False), ([9], True)]
    assert (messages[3].scheduled[0].blocks, messages[3].scheduled[0].full_table) == (
        [1, 2, 3],
        True,
    )
    assert (messages[4].scheduled[0].blocks, messages[4].scheduled[0].full_table) == ([6], True)
    assert set(encoder.tables) == {"b"}
    assert "repetition_penalty" not in pickle.dumps(messages[0]).decode("latin-1")
    # A decode step of 64 requests stays small (each request: id, token, position, flags),
    # a fraction of the scheduler's own output (which carries prompts and sampling params).
    encoder = StepEncoder()
    many = [_sched(f"req-{i}", PROMPT, 0, [i]) for i in range(64)]
    encoder.encode(SchedulerOutput(many))
    step = SchedulerOutput(
        [
            ScheduledRequest(f"req-{i}", [1], 40, [i], True, PARAMS, list(range(i, i + 40)))
            for i in range(64)
        ]
    )
    size = len(pickle.dumps(encoder.encode(step), protocol=pickle.HIGHEST_PROTOCOL))
    assert size < 64 * 32
    assert size < len(pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)) / 4


def test_kv_heads_split_below_and_replicate_above_their_number() -> None:
    assert [kv_head_range(2, TPGroup(r, 2)) for r in range(2)] == [(0, 1), (1, 1)]
    assert [kv_head_range(8, TPGroup(r, 4)) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    # 2 KV heads at TP 4: query heads 0-3 attend KV head 0 (ranks 0, 1), 4-7 KV head 1.
    assert [kv_head_range(2, TPGroup(r, 4)) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    with pytest.raises(ValueError, match="not a multiple"):
        kv_head_range(2, TPGroup(0, 3))


@pytest.mark.parametrize(
    ("heads", "size", "match"),
    [
        ((9, 3), 2, "num_attention_heads \\(9\\) is not divisible by tensor_parallel_size 2"),
        ((9, 3), 4, "num_attention_heads \\(9\\) is not divisible"),
        ((12, 4), 6, "above num_key_value_heads \\(4\\) and not a multiple"),
    ],
)
def test_a_degree_the_model_does_not_split_into_is_a_config_error(
    heads: tuple[int, int], size: int, match: str
) -> None:
    hf_config = LlamaConfig(
        num_attention_heads=heads[0],
        num_key_value_heads=heads[1],
        hidden_size=64 * heads[0],
        intermediate_size=1536,
    )
    with pytest.raises(ConfigError, match=match):
        check_tensor_parallel(hf_config, size)
    check_tensor_parallel(hf_config, heads[1])  # query and KV heads both divide


class CountingSlice:
    """A lazy safetensors slice that counts the bytes it hands out."""

    def __init__(self, inner: Any, counter: list[int]) -> None:
        self.inner, self.counter = inner, counter

    def __getitem__(self, index: Any) -> torch.Tensor:
        t = self.inner[index]
        self.counter[0] += t.numel() * t.element_size()
        return t


def _load_counted(model_dir: Path, tp: TPGroup) -> tuple[LlamaForCausalLM, int]:
    hf_config = load_hf_config(model_dir)
    platform = select_platform("torch", torch.device("cpu"), torch.float32)
    model = LlamaForCausalLM(hf_config, 64, platform, tp)
    counter = [0]
    files = sorted(model_dir.glob("*.safetensors"))
    model.load_weights((n, CountingSlice(s, counter)) for n, s in checkpoint_slices(files))
    return model, counter[0]


@pytest.mark.model
def test_each_rank_loads_exactly_its_slice_of_the_default_model_and_reads_only_it() -> None:
    model_dir = resolve_model_dir("default")
    hf_config = load_hf_config(model_dir)
    platform = select_platform("torch", torch.device("cpu"), torch.float32)
    full = load_model(hf_config, model_dir, torch.float32, torch.device("cpu"), 64, platform)
    full_bytes = sum(p.numel() * p.element_size() for p in full.parameters())
    q, kv, inter = 9 * 64, 3 * 64, 1536  # SmolLM2-135M: 9 query, 3 KV heads of 64; MLP 1,536
    vocab = hf_config.vocab_size
    for rank in range(3):
        shard, read = _load_counted(model_dir, TPGroup(rank, 3))
        # A rank reads a third of the sharded weights plus the norms every rank holds.
        norms = sum(p.numel() * 4 for n, p in full.named_parameters() if "norm" in n)
        assert read == pytest.approx((full_bytes - norms) / 3 + norms, rel=1e-3), read
        for (name, got), (_, want) in zip(
            shard.named_parameters(), full.named_parameters(), strict=True
        ):
            if name.endswith("qkv_proj.weight"):
                parts = [want[:q], want[q : q + kv], want[q + kv :]]
                sizes = [q // 3, kv // 3, kv // 3]
                want = torch.cat(
                    [p[rank * n : (rank + 1) * n] for p, n in zip(parts, sizes, strict=True)]
                )
            elif name.endswith("gate_up_proj.weight"):
                gate, up = want[:inter], want[inter:]
                n = inter // 3
                want = torch.cat([gate[rank * n : (rank + 1) * n], up[rank * n : (rank + 1) * n]])
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                n = want.shape[1] // 3
                want = want[:, rank * n : (rank + 1) * n]
            elif name == "embed_tokens.weight":
                n = vocab // 3
                want = want[rank * n : (rank + 1) * n]
            assert torch.equal(got, want), (rank, name)


class _Driver:
    """Rank 0's runner, recording the steps it ran (``fail``: raise on the next one)."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls
        self.device = torch.device("cpu")
        self.states: dict[str, Any] = {}
        self.fail = False

    def execute_model(self, out: SchedulerOutput) -> Any:
        if self.fail:
            raise RuntimeError("gloo: connection closed by peer")
        self.calls.append("driver")
        return "output"


class _Workers:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def broadcast(self, out: SchedulerOutput) -> None:
        self.calls.append("broadcast")

    def step_failed(self, error: BaseException) -> TensorParallelError:
        self.calls.append(f"failed: {error}")
        return TensorParallelError("rank 1 died")


def test_the_tensor_parallel_runner_broadcasts_first_and_fails_the_replica_on_any_error() -> None:
    calls: list[str] = []
    driver = _Driver(calls)
    runner = TensorParallelRunner(driver, _Workers(calls))
    assert runner.execute_model(SchedulerOutput([])) == "output"
    assert calls == ["broadcast", "driver"]
    driver.fail = True
    with pytest.raises(TensorParallelError, match="rank 1 died"):
        runner.execute_model(SchedulerOutput([]))
    assert calls[2:] == ["broadcast", "failed: gloo: connection closed by peer"]
