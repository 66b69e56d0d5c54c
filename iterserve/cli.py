"""The ``iterserve`` command. Engine flags derive from the config dataclasses' fields.

Building the parser imports no torch, numpy or server stack (``iterserve --help`` is quick):
each subcommand imports what it needs when it runs."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any

from iterserve.bench.cli_args import add_bench_parsers
from iterserve.config import (
    ENGINE_CONFIG_CLASSES,
    ConfigError,
    ServerConfig,
    SimulationConfig,
    load_config_file,
)
from iterserve.engine_flags import add_engine_flags
from iterserve.operator.cli_args import add_operator_args
from iterserve.router.cli_args import add_router_args, add_router_subcommands
from iterserve.sim.cli_args import add_simulate_args
from iterserve.telemetry.cli_args import add_report_args

_EXAMPLE_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about continuous batching.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three facts about the Moon.",
]


def engine_kwargs(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    classes: tuple[type, ...] = ENGINE_CONFIG_CLASSES,
) -> dict[str, Any]:
    """Keywords of ``classes`` (default: ``LLM(...)``'s): the ``--config`` file's values,
    overridden by flags given."""
    known = {f.name for cls in classes for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    if args.config is not None:
        try:
            kwargs = load_config_file(args.config, known)
        except ValueError as e:
            parser.error(str(e))
    kwargs.update({k: v for k, v in vars(args).items() if k in known})
    return kwargs


def _cmd_generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from iterserve.engine.errors import InvalidRequestError
    from iterserve.engine.sampling_params import SamplingParams
    from iterserve.llm import LLM
    from iterserve.models.loader import ModelNotFoundError

    try:
        llm = LLM(**engine_kwargs(args, parser))
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos
        )
        prompts = args.prompt or _EXAMPLE_PROMPTS
        start = time.perf_counter()
        if args.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
        else:
            outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        cfg = llm.config
        print(
            f"model {llm.loaded.model_dir.name} ({cfg.model.dtype}), {llm.loaded.num_kv_blocks} "
            f"KV blocks of {cfg.cache.block_size} tokens, max_num_seqs "
            f"{cfg.scheduler.max_num_seqs}, max_num_batched_tokens "
            f"{cfg.scheduler.max_num_batched_tokens}"
        )
    except (ConfigError, InvalidRequestError, ModelNotFoundError, TypeError) as e:
        print(f"iterserve generate: error: {e}", file=sys.stderr)
        return 2
    num_out = 0
    for prompt, out in zip(prompts, outs, strict=True):
        completion = out.outputs[0]
        num_out += len(completion.token_ids)
        print(f"--- prompt: {prompt!r}")
        print(f"{completion.text}")
        print(f"--- [{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}]")
    print(
        f"{len(outs)} requests, {num_out} output tokens in {elapsed:.2f} s "
        f"({num_out / elapsed:.1f} tokens/s, {llm.engine.num_iterations} iterations)"
    )
    plan = llm.loaded.driver.model.quantization_plan
    if plan is not None:
        print(f"quantization {plan.describe()}")
    return 0


def _cmd_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from iterserve import envs

    kwargs = engine_kwargs(args, parser, (*ENGINE_CONFIG_CLASSES, ServerConfig, SimulationConfig))
    server_kwargs = _pop_fields(kwargs, ServerConfig)
    sim_kwargs = _pop_fields(kwargs, SimulationConfig)
    server_kwargs.setdefault("api_key", envs.ITERSERVE_API_KEY)
    server_kwargs.setdefault("admin_token", envs.ITERSERVE_ADMIN_TOKEN)
    try:
        server_config = ServerConfig(**server_kwargs)
        sim = SimulationConfig(**sim_kwargs)
        if sim.simulate is not None:
            from iterserve.sim.profile import ProfileError
            from iterserve.sim.replica import serve_simulated

            try:
                return serve_simulated(kwargs, server_config, sim)
            except ProfileError as e:
                raise ConfigError(str(e)) from e
        from iterserve.server.launch import serve

        return serve(kwargs, server_config)
    except (ConfigError, TypeError) as e:
        print(f"iterserve serve: error: {e}", file=sys.stderr)
        return 2


def _pop_fields(kwargs: dict[str, Any], cls: type) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: kwargs.pop(k) for k in list(kwargs) if k in names}


def _cmd_router(args: argparse.Namespace) -> int:
    if getattr(args, "router_command", None) == "envoy-config":
        from iterserve.router.envoy_bootstrap import print_config

        return print_config(args)
    from iterserve.router.server import main

    return main(args)


def _cmd_operator(args: argparse.Namespace) -> int:
    from iterserve.operator.main import main

    return main(args)


def _cmd_report(args: argparse.Namespace) -> int:
    from iterserve.telemetry.report import main

    return main(args)


def _cmd_simulate(args: argparse.Namespace) -> int:
    from iterserve.sim.simulate import main

    return main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="iterserve",
        description="Continuous-batching LLM serving: serve, generate offline, benchmark.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    srv = sub.add_parser("serve", help="the OpenAI-compatible server of one replica")
    add_engine_flags(srv, (ServerConfig, *ENGINE_CONFIG_CLASSES, SimulationConfig))
    srv.set_defaults(func=_cmd_serve, subparser=srv)
    gen = sub.add_parser("generate", help="offline generation from the command line")
    add_engine_flags(gen)
    gen.add_argument(
        "--prompt", action="append", help="a prompt (repeatable; default: 4 example prompts)"
    )
    gen.add_argument("--max-tokens", type=int, default=64, help="(default: 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="(default: 0, greedy)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument(
        "--chat", action="store_true", help="apply the model's chat template to each prompt"
    )
    gen.set_defaults(func=_cmd_generate, subparser=gen)
    rtr = sub.add_parser("router", help="route requests to the replica with the least KV pressure")
    add_router_args(rtr)
    add_router_subcommands(rtr)
    rtr.set_defaults(func=_cmd_router)
    op = sub.add_parser("operator", help="the Kubernetes operator of LLMDeployment resources")
    add_operator_args(op)
    op.set_defaults(func=_cmd_operator)
    sim = sub.add_parser(
        "simulate", help="what-if replay of a trace under candidate configs, in virtual time"
    )
    add_simulate_args(sim)
    sim.set_defaults(func=_cmd_simulate)
    rep = sub.add_parser(
        "report", help="per-tenant and per-tier latency, queue time, preemptions (telemetry DB)"
    )
    add_report_args(rep)
    rep.set_defaults(func=_cmd_report)
    bench = sub.add_parser("bench", help="benchmarks")
    add_bench_parsers(bench.add_subparsers(dest="bench_command", required=True))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("generate", "serve"):
        return int(args.func(args, args.subparser))
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
