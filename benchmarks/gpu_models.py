"""Random Llama models and iterserve engines built without a model directory or tokenizer,
for ``python -m benchmarks.gpu`` (section 5 here: the engine on the device against the CPU).

The weights come from ``transformers``' own ``LlamaForCausalLM``, randomly initialised on the
device (its ``_init_weights``: normal(0, 0.02) linears and embeddings, unit norms), and load
into iterserve's model through :meth:`~iterserve.models.llama.LlamaForCausalLM.load_weights`,
so both libraries run the same numbers. The engine is wired as
:func:`iterserve.executor.build.build` wires it, with the KV pool's size given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from iterserve.config import EngineConfig, GiB
from iterserve.engine.factory import ModelInfo, build_engine
from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.sampling_params import SamplingParams

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


@dataclass(frozen=True)
class LlamaShape:
    """A Llama decoder's sizes (Llama-3-8B's by default)."""

    hidden_size: int = 4096
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 8
    intermediate_size: int = 14336
    vocab_size: int = 128256
    rope_theta: float = 500000.0


def llama_config(shape: LlamaShape, max_position: int) -> Any:
    """A ``transformers.LlamaConfig`` of ``shape`` (untied embeddings, default rope).

    Raises:
        RuntimeError: this transformers (< 5) does not read ``rope_parameters``.
    """
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        intermediate_size=shape.intermediate_size,
        vocab_size=shape.vocab_size,
        max_position_embeddings=max_position,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_theta") != shape.rope_theta:
        raise RuntimeError(f"LlamaConfig did not take rope_theta {shape.rope_theta}: {rope}")
    return config


def random_hf_llama(hf_config: Any, dtype: torch.dtype, device: torch.device, seed: int) -> Any:
    """``transformers.LlamaForCausalLM`` of ``hf_config`` in ``dtype``, created on ``device``
    and initialised there from a seeded generator: normal(0, 0.02) matrices and embeddings,
    unit norm weights (transformers' own init, done here so it does not depend on the
    version)."""
    from transformers import LlamaForCausalLM as HfLlama

    with torch.device(device):
        try:
            model = HfLlama._from_config(hf_config, dtype=dtype)
        except TypeError:  # transformers < 5 names it torch_dtype
            model = HfLlama._from_config(hf_config, torch_dtype=dtype)
    model = model.to(device=device, dtype=dtype).eval()
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:  # RMSNorm weights (Llama has no biases)
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    return model


def iterserve_llama(
    hf_model: Any, device: torch.device, dtype: torch.dtype, max_position: int, backend: str
) -> Any:
    """iterserve's :class:`~iterserve.models.llama.LlamaForCausalLM` on ``device`` in ``dtype``
    with ``hf_model``'s weights, on the platform ``backend`` selects there (as ``build``)."""
    from iterserve.kernels.platform import select_platform
    from iterserve.models.llama import LlamaForCausalLM

    platform = select_platform(backend, device, dtype)
    with torch.device(device):
        model = LlamaForCausalLM(hf_model.config, max_position, platform)
    model.load_weights(hf_model.state_dict().items())
    model = model.to(dtype).eval()
    model.pack_linear_weights()
    return model


def make_engine(
    model: Any,
    num_kv_blocks: int,
    max_model_len: int,
    num_host_blocks: int = 0,
    block_size: int = 16,
    **scheduler_kwargs: Any,
) -> LLMEngine:
    """An :class:`LLMEngine` on ``model`` with a KV pool of ``num_kv_blocks`` blocks (and a
    host pool of ``num_host_blocks`` for swapping), no tokenizer and no EOS token.

    ``scheduler_kwargs`` are engine config keywords (``max_num_seqs``, ``preemption_mode``,
    ``enforce_eager``, ...). Decode CUDA graphs are captured as ``iterserve serve`` captures
    them (on CUDA with the Triton platform, unless ``enforce_eager``).
    """
    from iterserve.executor.attention import KVCache
    from iterserve.executor.graph_capture import capture_decode_graphs, use_cuda_graphs
    from iterserve.executor.model_runner import TorchModelRunner

    dtype = model.embed_tokens.weight.dtype
    device = model.embed_tokens.weight.device
    layers = len(model.layers)
    per_block = KVCache.bytes_per_block(
        layers, block_size, model.num_kv_heads, model.head_dim, dtype
    )
    config = EngineConfig.from_kwargs(
        dtype=DTYPE_NAMES[dtype],
        max_model_len=max_model_len,
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        swap_space=num_host_blocks * per_block / GiB,
        **scheduler_kwargs,
    )
    kv_cache = KVCache(
        layers,
        num_kv_blocks,
        block_size,
        model.num_kv_heads,
        model.head_dim,
        dtype,
        device,
        num_host_blocks,
    )
    runner = TorchModelRunner(model, kv_cache, config.model.seed)
    if use_cuda_graphs(config, device, model.platform):
        capture_decode_graphs(runner, config)
    info = ModelInfo(int(model.config.vocab_size), frozenset(), num_kv_blocks, num_host_blocks)
    return build_engine(config, runner, None, info)


def run_engine(
    engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]
) -> dict[str, RequestOutput]:
    """Add every ``(prompt_token_ids, params)`` request (ids ``"0"``, ``"1"``, ...) and step
    until all finished; their final outputs by id."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


# ----------------------------------------------------------------- section 5


def parity_workload(
    vocab_size: int, seed: int, num_requests: int = 12, max_tokens: int = 24
) -> list[tuple[list[int], SamplingParams]]:
    """``num_requests`` requests in 3 groups sharing a 40-token prefix (prefix caching),
    suffixes of 3-29 tokens, ``max_tokens`` greedy tokens each; every third asks for 2
    completions, every other for the top-3 logprobs."""
    import random

    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab_size) for _ in range(40)] for _ in range(3)]
    requests = []
    for i in range(num_requests):
        suffix = [rng.randrange(vocab_size) for _ in range(3 + (i * 7) % 27)]
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            n=2 if i % 3 == 0 else 1,
            logprobs=3 if i % 2 else None,
        )
        requests.append((prefixes[i % 3] + suffix, params))
    return requests


# Engine settings of the parity runs: a 32-token budget chunks every prompt (43-69 tokens);
# 12 blocks of 16 tokens hold 2-3 requests (up to 93 tokens each): preemptions, also with 6
# requests of 8 tokens (the CPU test).
PARITY_RUNS: dict[str, dict[str, Any]] = {
    "recompute": dict(preemption_mode="recompute"),
    "swap": dict(preemption_mode="swap"),
}
PARITY_ENGINE = dict(num_kv_blocks=12, max_model_len=128, max_num_batched_tokens=32, max_num_seqs=8)
PARITY_SHAPE = LlamaShape(256, 2, 4, 2, 512, 1024)


def run_engine_parity(
    device: torch.device,
    backend: str,
    num_requests: int = 12,
    max_tokens: int = 24,
    seed: int = 0,
    enforce_eager: bool = False,
) -> dict[str, Any]:
    """The same float32 random Llama through the engine on ``device`` (``backend``) and on
    the CPU (plain torch), per :data:`PARITY_RUNS`: greedy token ids must be equal.

    Raises:
        SectionFailed: some completion's token ids differ (the results are attached).
    """
    from benchmarks.gpu_kernels import SectionFailed

    hf = random_hf_llama(llama_config(PARITY_SHAPE, 128), torch.float32, torch.device("cpu"), seed)
    models = {
        "device": iterserve_llama(hf, device, torch.float32, 128, backend),
        "cpu": iterserve_llama(hf, torch.device("cpu"), torch.float32, 128, "torch"),
    }
    workload = parity_workload(PARITY_SHAPE.vocab_size, seed, num_requests, max_tokens)
    runs: dict[str, Any] = {}
    num_mismatches = 0
    for run_name, settings in PARITY_RUNS.items():
        outputs, counters = {}, {}
        for where, model in models.items():
            host_blocks = 64 if settings["preemption_mode"] == "swap" else 0
            engine = make_engine(
                model,
                num_host_blocks=host_blocks,
                enforce_eager=enforce_eager,
                **PARITY_ENGINE,
                **settings,
            )
            outputs[where] = run_engine(engine, workload)
            counters[where] = _engine_counters(engine)
        mismatches = _compare(outputs["device"], outputs["cpu"])
        num_mismatches += len(mismatches)
        runs[run_name] = {
            "settings": {**PARITY_ENGINE, **settings},
            "counters": counters,
            "num_completions": sum(len(o.outputs) for o in outputs["cpu"].values()),
            "mismatches": mismatches,
            "max_logprob_diff": _max_logprob_diff(outputs["device"], outputs["cpu"]),
        }
    result = {
        "model": {**PARITY_SHAPE.__dict__, "dtype": "float32"},
        "device": str(device),
        "workload": {"num_requests": num_requests, "max_tokens": max_tokens, "prefix_tokens": 40},
        "backend": models["device"].platform.name,
        "runs": runs,
        "num_mismatches": num_mismatches,
    }
    if num_mismatches:
        raise SectionFailed(f"{num_mismatches} completions differ device vs CPU", result)
    return result


def _engine_counters(engine: LLMEngine) -> dict[str, int]:
    sched = engine.scheduler
    by_cause = sched.num_preemptions_by_cause
    return {
        "iterations": engine.num_iterations,
        "preemptions_recompute": sum(v for (mode, _), v in by_cause.items() if mode == "recompute"),
        "preemptions_swap": sum(v for (mode, _), v in by_cause.items() if mode == "swap"),
        "prefix_cache_hit_tokens": sched.num_prefix_cache_hits,
        "prefill_iterations": sum(1 for t in engine.telemetry if t.num_prefill_tokens),
    }


def _compare(
    device_out: dict[str, RequestOutput], cpu_out: dict[str, RequestOutput]
) -> list[dict[str, Any]]:
    """Completions whose token ids differ: request, index and the first differing position."""
    mismatches = []
    for request_id, expected in sorted(cpu_out.items(), key=lambda kv: int(kv[0])):
        got = device_out.get(request_id)
        for c in expected.outputs:
            got_ids = got.outputs[c.index].token_ids if got else []
            if got_ids != c.token_ids:
                pairs = zip(got_ids, c.token_ids, strict=False)
                first = next(
                    (i for i, (a, b) in enumerate(pairs) if a != b),
                    min(len(got_ids), len(c.token_ids)),
                )
                mismatches.append({"request_id": request_id, "index": c.index, "position": first})
    return mismatches


def _max_logprob_diff(
    device_out: dict[str, RequestOutput], cpu_out: dict[str, RequestOutput]
) -> float:
    diff = 0.0
    for request_id, expected in cpu_out.items():
        got = device_out.get(request_id)
        if got is None:
            continue
        for a, b in zip(got.outputs, expected.outputs, strict=True):
            for la, lb in zip(a.logprobs or [], b.logprobs or [], strict=False):
                if la.token_id == lb.token_id:
                    diff = max(diff, abs(la.logprob - lb.logprob))
    return diff
