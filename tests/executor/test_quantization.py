"""``--quantization``: refused where it cannot run, the crossover measured as documented, and on
the real model the quantized kernels serving with a perplexity close to bfloat16's."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import torch

from iterserve.config import ConfigError, EngineConfig
from iterserve.executor import quantization
from iterserve.executor.quantization import check_quantization, measure_crossover
from iterserve.kernels.quantized_linear import Int4Linear, Int8Linear, RowsDispatch

CPU, BF16 = torch.device("cpu"), torch.bfloat16


@pytest.mark.parametrize(
    ("mode", "device", "dtype", "tp", "model", "message"),
    [
        ("int8", torch.device("cuda"), BF16, 1, "default", "runs on CPUs only today"),
        ("q4", CPU, torch.float32, 1, "default", "computes in bfloat16"),
        ("q4", CPU, BF16, 2, "default", "tensor_parallel_size 1"),
        ("q4", CPU, BF16, 1, "/models/llama", "is no .gguf file"),
    ],
    ids=["cuda", "float32", "tensor-parallel", "directory"],
)
def test_what_cannot_run_is_refused_before_loading(
    mode: str, device: torch.device, dtype: torch.dtype, tp: int, model: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        check_quantization(mode, device, dtype, tp, model)


def test_the_engine_config_refuses_a_dtype_it_cannot_quantize() -> None:
    with pytest.raises(ConfigError, match="quantization computes in bfloat16"):
        EngineConfig.from_kwargs(quantization="int8", dtype="float32")
    assert EngineConfig.from_kwargs(quantization="q4").model.quantization == "q4"


def _sleeper(per_row_s: float, fixed_s: float, calls: list[int]) -> Any:
    def op(x: torch.Tensor, bias: Any) -> torch.Tensor:
        calls.append(x.shape[0])
        time.sleep(fixed_s + per_row_s * x.shape[0])
        return x

    return op


def test_the_small_kernel_is_kept_while_it_wins_and_measuring_stops_after_two_losses() -> None:
    small_calls: list[int] = []
    small = [_sleeper(1e-3, 0.0, small_calls)]  # cheap per call, slow per row
    large = [_sleeper(0.0, 6e-3, [])]  # 6 ms whatever the rows: small wins up to 4 rows
    max_small, timings = measure_crossover(small, large, [8])
    assert max_small == 4
    assert list(timings) == [1, 2, 4, 8, 16]  # lost at 8 and 16, then stopped
    assert small_calls.count(16) == quantization.MEASURE_REPEATS + 1 and 32 not in small_calls


def test_a_fixed_crossover_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ITERSERVE_QUANTIZATION_SMALL_ROWS", "many")
    with pytest.raises(ValueError, match="integer >= 0"):
        quantization.envs.quantization_small_rows()
    monkeypatch.setenv("ITERSERVE_QUANTIZATION_SMALL_ROWS", "3")
    assert quantization.envs.quantization_small_rows() == 3


def _perplexity(llm: Any, num_tokens: int = 512) -> float:
    from iterserve.bench.quality import perplexity_text, token_logprobs

    ids = llm.tokenizer(perplexity_text()).input_ids[:num_tokens]
    logprobs = token_logprobs(llm.loaded.driver, ids)
    return math.exp(-sum(logprobs) / len(logprobs))


@pytest.fixture(scope="module")
def bf16_perplexity() -> float:
    from iterserve import LLM

    with LLM(num_kv_blocks=64) as llm:
        return _perplexity(llm)


@pytest.mark.model
@pytest.mark.parametrize(
    ("mode", "small_rows", "kernel"), [("int8", "0", Int8Linear), ("q4", "100000", Int4Linear)]
)
def test_the_quantized_model_serves_with_bf16s_perplexity(
    mode: str,
    small_rows: str,
    kernel: type,
    bf16_perplexity: float,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every decoder linear on the quantized kernel (forced: the perplexity pass prefills
    256-token chunks); within 5% of bfloat16's perplexity on the shipped text (measured: int8
    +1%, q4 +0%), and it generates."""
    from iterserve import LLM, SamplingParams

    monkeypatch.setenv("ITERSERVE_QUANTIZATION_SMALL_ROWS", small_rows)
    with LLM(quantization=mode, num_kv_blocks=64) as llm:
        model = llm.loaded.driver.model
        ops = [module.packed for _, module in model.linear_layers()]
        assert len(ops) == 120
        for op in ops:  # q4 keeps bfloat16 above its rows; int8 at 0 rows is int8 alone
            assert isinstance(op.small if isinstance(op, RowsDispatch) else op, kernel)
        perplexity = _perplexity(llm)
        out = llm.generate(
            ["The capital of France is"], SamplingParams(max_tokens=8, temperature=0)
        )
    assert perplexity != bf16_perplexity  # another computation...
    assert abs(perplexity / bf16_perplexity - 1) < 0.05  # ...of nearly the same function
    assert "Paris" in out[0].outputs[0].text
