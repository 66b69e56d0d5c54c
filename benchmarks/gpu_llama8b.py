"""``python -m benchmarks.gpu`` sections 3 and 4 on a randomly initialised Llama-3-8B-shaped model:
offline throughput of iterserve against ``transformers``' continuous batching, and the decode
iteration time at batch 64 against its weight-and-KV read floor.

Both sections share one model (built once, by :class:`SharedLlama`): transformers' model is
initialised on the device, iterserve's loads its weights. Section 4 runs first; section 3
frees iterserve's model and KV pool before transformers' continuous batching sizes its own
cache from the free memory.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any

import torch

from benchmarks.gpu_kernels import SectionFailed, copy_bandwidth
from benchmarks.gpu_models import (
    DTYPE_NAMES,
    LlamaShape,
    iterserve_llama,
    llama_config,
    make_engine,
    random_hf_llama,
    run_engine,
)
from benchmarks.gpu_transformers import transformers_throughput
from iterserve.engine.sampling_params import SamplingParams

BLOCK_SIZE = 16
# Prefill tokens per iteration: whole prompts of many requests at once (vLLM's default).
MAX_NUM_BATCHED_TOKENS = 8192


@dataclass(frozen=True)
class LlamaBenchSettings:
    """Model and workload of sections 3 and 4 (tokens, seconds)."""

    shape: LlamaShape
    dtype: torch.dtype
    backend: str  # iterserve's --attention-backend on the device
    enforce_eager: bool  # iterserve's --enforce-eager (no decode CUDA graphs)
    num_requests: int  # section 3: requests, all arriving at once
    prompt_len: int  # random token ids, fixed length
    output_len: int  # greedy, EOS ignored, exactly this many
    decode_batch: int  # section 4
    decode_context: int  # prompt tokens of each decoding request
    decode_steps: int  # timed pure-decode iterations
    hf_timeout_s: float  # transformers' run stops waiting after this
    copy_bytes: int
    seed: int = 0

    @property
    def max_model_len(self) -> int:
        longest = max(
            self.prompt_len + self.output_len, self.decode_context + self.decode_steps + 8
        )
        return -(-longest // 256) * 256


class SharedLlama:
    """The model of sections 3 and 4, built on first use."""

    def __init__(self, settings: LlamaBenchSettings, device: torch.device) -> None:
        self.settings = settings
        self.device = device
        self._hf: Any = None
        self._ours: Any = None
        self.build_s: dict[str, float] = {}

    def hf_model(self) -> Any:
        if self._hf is None:
            s = self.settings
            start = time.perf_counter()
            config = llama_config(s.shape, s.max_model_len)
            self._hf = random_hf_llama(config, s.dtype, self.device, s.seed)
            self.build_s["transformers_init"] = time.perf_counter() - start
        return self._hf

    def iterserve_model(self) -> Any:
        if self._ours is None:
            s = self.settings
            hf = self.hf_model()
            start = time.perf_counter()
            self._ours = iterserve_llama(hf, self.device, s.dtype, s.max_model_len, s.backend)
            self.build_s["iterserve_load"] = time.perf_counter() - start
        return self._ours

    def free_iterserve(self) -> None:
        self._ours = None
        _free_memory(self.device)

    def free_all(self) -> None:
        self._hf = None
        self.free_iterserve()


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _with_margin(num_blocks: int) -> int:
    """Blocks for ``num_blocks`` of KV plus the scheduler's watermark and some to spare: no
    request waits for blocks."""
    return num_blocks + num_blocks // 10 + 16


def _model_info(model: Any, settings: LlamaBenchSettings) -> dict[str, Any]:
    return {
        **asdict(settings.shape),
        "dtype": DTYPE_NAMES[settings.dtype],
        "weight_bytes": model.weight_bytes(),
        "platform": model.platform.name,
    }


def _prompts(settings: LlamaBenchSettings, num: int, length: int) -> list[list[int]]:
    rng = random.Random(settings.seed)
    vocab = settings.shape.vocab_size
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(num)]


# ----------------------------------------------------------------- section 4


def run_decode_floor(shared: SharedLlama) -> dict[str, Any]:
    """Median engine-step time of pure-decode iterations at ``decode_batch`` requests against
    the floor ``(weight bytes read + KV bytes read) / copy bandwidth``; target <= 1.3x.

    The weights read are all but the embedding table (a decode reads ``batch`` rows of it);
    the KV read is every request's context (all layers, keys and values) at that step.
    """
    s, device = shared.settings, shared.device
    model = shared.iterserve_model()
    batch, context = s.decode_batch, s.decode_context
    num_tokens = context + s.decode_steps + 8
    num_blocks = _with_margin(batch * -(-num_tokens // BLOCK_SIZE))
    engine = make_engine(
        model,
        num_kv_blocks=num_blocks,
        max_model_len=s.max_model_len,
        max_num_seqs=batch,
        max_num_batched_tokens=max(MAX_NUM_BATCHED_TOKENS, batch),
        enforce_eager=s.enforce_eager,
    )
    params = SamplingParams(max_tokens=s.decode_steps + 8, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(_prompts(s, batch, context)):
        engine.add_request(str(i), prompt, params)
    # Prefill until every request decodes, then 2 decode iterations of warm-up.
    for _ in range(batch * context):
        engine.step()
        last = engine.telemetry[-1]
        if last.num_prefill_tokens == 0 and last.num_scheduled_seqs == batch:
            break
    for _ in range(2):
        engine.step()
    # The last prefill step sampled token 1, the first pure decode and the 2 warm-ups wrote
    # tokens 1-3 and sampled 4: timed step j writes token 4 + j and reads context + 4 + j
    # tokens of KV.
    latencies, kv_tokens = [], []
    for j in range(s.decode_steps):
        engine.step()
        last = engine.telemetry[-1]
        if last.num_prefill_tokens or last.num_scheduled_seqs != batch:
            raise RuntimeError(f"decode step {j} was not a pure decode of {batch} requests")
        latencies.append(last.latency_s)
        kv_tokens.append(batch * (context + 4 + j))
    bytes_per_token = engine.runner.kv_cache.bytes_per_token  # type: ignore[attr-defined]
    kv_bytes = statistics.mean(kv_tokens) * bytes_per_token
    embedding_bytes = model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    weight_bytes = model.weight_bytes() - embedding_bytes
    del engine
    _free_memory(device)
    bandwidth = copy_bandwidth(device, s.copy_bytes)
    floor_s = (weight_bytes + kv_bytes) / bandwidth
    iteration_s = statistics.median(latencies)
    return {
        "model": _model_info(model, s),
        "batch": batch,
        "context": context,
        "num_steps": s.decode_steps,
        "iteration_ms": iteration_s * 1e3,
        "iteration_ms_min": min(latencies) * 1e3,
        "weight_bytes_read": weight_bytes,
        "kv_bytes_read": kv_bytes,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "floor_ms": floor_s * 1e3,
        "vs_floor": iteration_s / floor_s,
        "target": "<= 1.3x the floor",
        "target_met": iteration_s / floor_s <= 1.3,
        "build_s": dict(shared.build_s),
    }


# ----------------------------------------------------------------- section 3


def run_offline(shared: SharedLlama) -> dict[str, Any]:
    """Generated tokens per second of iterserve and of transformers' continuous batching on
    the same prompts (random ids, fixed lengths, greedy, EOS ignored, same output length),
    and their ratio (target >= 3x). Warm-ups are not timed."""
    s, device = shared.settings, shared.device
    prompts = _prompts(s, s.num_requests, s.prompt_len)
    model = shared.iterserve_model()
    info = _model_info(model, s)
    ours = _iterserve_throughput(model, prompts, s)
    del model  # transformers sizes its cache from the free memory
    shared.free_iterserve()
    result: dict[str, Any] = {
        "model": info,
        "workload": {
            "num_requests": s.num_requests,
            "prompt_len": s.prompt_len,
            "output_len": s.output_len,
        },
        "iterserve": ours,
        "target": ">= 3x transformers continuous batching",
    }
    try:
        theirs = transformers_throughput(
            shared.hf_model(), prompts, s.output_len, s.hf_timeout_s, device,
            max_batch_tokens=MAX_NUM_BATCHED_TOKENS,
        )  # fmt: skip
    except Exception as e:  # keep iterserve's figures
        ours.pop("token_ids")
        result["transformers"] = {"error": repr(e), "traceback": traceback.format_exc()}
        raise SectionFailed(f"transformers' continuous batching failed: {e!r}", result) from e
    finally:
        shared.free_all()
    agree = [
        a[:1] == b[:1]
        for a, b in zip(ours.pop("token_ids"), theirs.pop("token_ids"), strict=True)
        if b
    ]
    ratio = ours["tokens_per_s"] / theirs["tokens_per_s"] if theirs["tokens_per_s"] else None
    return result | {
        "transformers": theirs,
        "ratio": ratio,
        "target_met": None if ratio is None else ratio >= 3.0,
        # Same weights, different kernels in bfloat16: most first tokens should agree.
        "first_token_agreement": sum(agree) / len(agree) if agree else None,
    }


def _iterserve_throughput(
    model: Any, prompts: list[list[int]], s: LlamaBenchSettings
) -> dict[str, Any]:
    num_blocks = _with_margin(len(prompts) * -(-(s.prompt_len + s.output_len) // BLOCK_SIZE))
    max_num_seqs = min(len(prompts), 256)
    engine = make_engine(
        model,
        num_kv_blocks=num_blocks,
        max_model_len=s.max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(MAX_NUM_BATCHED_TOKENS, max_num_seqs),
        enforce_eager=s.enforce_eager,
    )
    params = SamplingParams(
        max_tokens=s.output_len, min_tokens=s.output_len, temperature=0.0, ignore_eos=True
    )
    run_engine(engine, [(p, params) for p in prompts[:2]])  # warm-up: compiles the kernels
    warmup_iterations = engine.num_iterations
    start = time.perf_counter()
    outputs = run_engine(engine, [(p, params) for p in prompts])
    seconds = time.perf_counter() - start
    token_ids = [outputs[str(i)].outputs[0].token_ids for i in range(len(prompts))]
    generated = sum(map(len, token_ids))
    return {
        "generated_tokens": generated,
        "seconds": seconds,
        "tokens_per_s": generated / seconds,
        "iterations": engine.num_iterations - warmup_iterations,
        "max_num_seqs": max_num_seqs,
        "num_kv_blocks": num_blocks,
        "token_ids": token_ids,
    }
