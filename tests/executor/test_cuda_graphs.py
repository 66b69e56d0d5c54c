"""The padded static-buffer decode path (what CUDA graphs capture), run eagerly on the CPU: the
same tokens and logits as the unpadded path, no KV written for padding rows. Capture itself
needs CUDA (see docs/gpu.md)."""

from __future__ import annotations

import pytest
import torch
from tiny_llama import tiny_model

from iterserve import envs
from iterserve.engine.outputs import ScheduledRequest, SchedulerOutput
from iterserve.engine.sampling_params import SamplingParams
from iterserve.executor.attention import KVCache, PagedAttention
from iterserve.executor.cuda_graphs import bucket_for, decode_buckets, is_graph_decode
from iterserve.executor.model_runner import TorchModelRunner, prepare_inputs
from iterserve.kernels.platform import Platform, TorchPlatform, TritonPlatform

BLOCK_SIZE, NUM_BLOCKS, MAX_LEN = 16, 12, 64
CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=1)


def test_buckets_are_1_2_4_then_every_8_up_to_max_num_seqs() -> None:
    assert decode_buckets(1) == [1]
    assert decode_buckets(3) == [1, 2, 4]
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(100)[-3:] == [88, 96, 104]
    assert decode_buckets(128) == [1, 2, 4, *range(8, 129, 8)]
    assert bucket_for(3, [1, 2, 4]) == 4 and bucket_for(5, [1, 2, 4]) is None


def test_only_pure_decode_iterations_take_the_padded_path() -> None:
    decode = ScheduledRequest("a", [1], 4, [0], True, GREEDY)
    chunk = ScheduledRequest("b", [1, 2], 0, [1], True, GREEDY)
    unsampled = ScheduledRequest("c", [1], 4, [2], False, GREEDY)
    assert is_graph_decode([decode])
    assert not is_graph_decode([decode, chunk])
    assert not is_graph_decode([decode, unsampled])
    assert not is_graph_decode([])


def runner_on(platform: Platform, padded: bool, device: torch.device = CPU) -> TorchModelRunner:
    kv = KVCache(2, NUM_BLOCKS, BLOCK_SIZE, 2, 16, torch.float32, device)
    runner = TorchModelRunner(tiny_model(platform, hidden_size=64).to(device), kv, seed=0)
    if padded:
        runner.enable_padded_decode([1, 2, 4], MAX_LEN)
    return runner


def eager_logits(runner: TorchModelRunner, scheduled: list[ScheduledRequest]) -> torch.Tensor:
    inputs = prepare_inputs(scheduled, BLOCK_SIZE, runner.device)
    attention = PagedAttention(runner.kv_cache, inputs.metadata, runner.scale, runner.platform)
    hidden = runner.model(inputs.input_ids, inputs.positions, attention)
    return runner.model.compute_logits(hidden[inputs.logits_indices])


CASES = [
    pytest.param(TorchPlatform(), False, id="torch"),
    pytest.param(TritonPlatform(), False, id="triton"),
    pytest.param(
        TritonPlatform(),
        True,
        id="triton-cuda-graphs",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="capture needs CUDA"),
    ),
]


@pytest.mark.parametrize(("platform", "capture"), CASES)
def test_padded_decode_gives_the_unpadded_tokens_and_logits(
    platform: Platform, capture: bool, device: torch.device
) -> None:
    """Eager padded on the CPU (or the GPU where present); with capture, replayed graphs."""
    eager, padded = runner_on(platform, False, device), runner_on(platform, True, device)
    if capture:
        padded.capture_decode_graphs()
        assert padded.decode_graphs is not None
        assert sorted(padded.decode_graphs.graphs) == [1, 2, 4]
    # Three requests (the bucket of 4 pads one row); b's context crosses a block boundary.
    prompts = {"a": [1, 2, 3, 4, 5], "b": list(range(3, 18)), "c": [9, 8]}
    tables = {"a": [3], "b": [0, 5], "c": [7]}
    params = {"a": GREEDY, "b": GREEDY, "c": SEEDED}
    ids = {r: list(p) for r, p in prompts.items()}
    sched = [ScheduledRequest(r, ids[r], 0, tables[r], True, params[r], prompts[r]) for r in ids]
    for step in range(4):
        out = [
            r.execute_model(SchedulerOutput(scheduled=sched)).sampled_token_ids
            for r in (eager, padded)
        ]
        assert out[0] == out[1], f"step {step}"
        for r in ids:
            ids[r].append(out[0][r])
        sched = [
            ScheduledRequest(
                r, [ids[r][-1]], len(ids[r]) - 1, tables[r], True, params[r], prompts[r]
            )
            for r in ids
        ]
    assert padded.decode_graphs is not None
    # The last decode ran in the static buffers: 3 rows and a padding row.
    inputs = padded.decode_graphs.inputs
    assert inputs.seq_lens[:4].tolist() == [len(ids[r]) - 1 for r in ids] + [1]
    assert inputs.slot_mapping[3] == -1
    want = eager_logits(eager, sched)
    got = padded.decode_graphs.run(sched, 4)
    assert got.shape == want.shape == (3, 50)
    tol = 1e-5 if device.type == "cpu" else 1e-4  # GPU matmuls may tile 3 and 4 rows apart
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    # Padding rows wrote nothing: every block no request uses is still zero (a slot of -1
    # indexed as a tensor index would have written the pool's last slot).
    unused = [b for b in range(NUM_BLOCKS) if b not in {3, 0, 5, 7}]
    for cache in (*padded.kv_cache.key, *padded.kv_cache.value):
        assert not cache[:, unused].any()


def test_capture_refuses_a_cpu_device_and_a_platform_without_static_attention() -> None:
    if envs.triton_interpret():
        runner = runner_on(TritonPlatform(), True)
        with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device"):
            runner.capture_decode_graphs()
    runner = runner_on(TorchPlatform(), True)
    with pytest.raises(RuntimeError, match="no graph-safe decode attention"):
        runner.capture_decode_graphs()


def test_static_buffers_refuse_a_table_outside_the_pool() -> None:
    runner = runner_on(TorchPlatform(), True)
    assert runner.decode_graphs is not None
    bad = ScheduledRequest("a", [1], 3, [NUM_BLOCKS + 1], True, GREEDY)
    with pytest.raises(ValueError, match="block ids"):
        runner.decode_graphs.run([bad], 1)
