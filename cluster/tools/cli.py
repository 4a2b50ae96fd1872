"""The ``shapeserve`` command: serve, run-batch, bench, validate, demo-model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cluster.config import (
    ATTENTION_BACKENDS,
    CPU_BLOCK_SIZE,
    DTYPES,
    GPU_BLOCK_SIZE,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
)
from cluster.errors import ConfigError, ShapeserveError
from cluster.tool_calls import TOOL_CALL_PARSERS


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Engine flags; an unset one keeps the engine's default (``cluster.config``), as in a serve config."""
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="weights and KV cache dtype")
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1)")
    p.add_argument(
        "--attention-backend", default="auto", choices=ATTENTION_BACKENDS, help="auto: triton on CUDA, torch on CPU"
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help=f"tokens per KV block (default {CPU_BLOCK_SIZE} on a CPU, {GPU_BLOCK_SIZE} on a GPU)",
    )
    p.add_argument(
        "--num-blocks", type=int, default=None, help="KV blocks in the pool (default: from --kv-cache-memory-gb)"
    )
    p.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=None,
        help=f"KV pool size (default {CacheConfig.kv_cache_memory_gb})",
    )
    p.add_argument("--no-prefix-caching", action="store_true", help="disable automatic prefix caching")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help=f"token budget per engine step (default {SchedulerConfig.max_num_batched_tokens})",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help=f"most requests running at once (default {SchedulerConfig.max_num_seqs})",
    )
    p.add_argument("--long-prefill-token-threshold", type=int, default=None, help="largest prompt chunk per step")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument(
        "--max-model-len", type=int, default=None, help="context length served (default: the model's; at most it)"
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig.build(
        str(args.model),
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        num_threads=args.threads,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        enable_prefix_caching=not args.no_prefix_caching,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
    )


def read_chat_template(path: str | None) -> str | None:
    """The text of a ``--chat-template`` file (None without one); ConfigError naming the flag when it cannot be
    read or is not a Jinja template that renders a conversation."""
    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--chat-template {path!r} cannot be read: {e}", "chat_template") from None
    try:
        from transformers.utils.chat_template_utils import render_jinja_template

        render_jinja_template([[{"role": "user", "content": "hi"}]], chat_template=text, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - jinja raises many types for a broken template
        raise ConfigError(
            f"--chat-template {path!r} is not a chat template that renders: {e}", "chat_template"
        ) from None
    return text


def _cmd_run_batch(args: argparse.Namespace) -> int:
    from cluster.engine.llm_engine import LLMEngine
    from cluster.tools.batch import run_batch

    chat_template = read_chat_template(args.chat_template)
    engine = LLMEngine(engine_config_from_args(args))
    if chat_template is not None:
        engine.tokenizer.chat_template = chat_template
    model_name = args.served_model_name or Path(args.model).name
    with open(args.input, encoding="utf-8") as fin, open(args.output, "w", encoding="utf-8") as fout:
        ok, failed = run_batch(
            engine, fin, fout, model_name, progress=not args.no_progress, tool_call_parser=args.tool_call_parser
        )
    print(f"run-batch: {ok} succeeded, {failed} failed -> {args.output}", file=sys.stderr)
    return 0


def _cmd_demo_model(args: argparse.Namespace) -> int:
    from cluster.tools.demo_model import DemoModelSpec, write_demo_model

    spec = DemoModelSpec(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        max_position_embeddings=args.max_position_embeddings,
        tie_word_embeddings=args.tie_word_embeddings,
        architecture=args.architecture,
        seed=args.seed,
    )
    path = write_demo_model(args.dir, spec)
    print(f"wrote demo model to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shapeserve", description="Disaggregated LLM serving on Ray")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start the OpenAI-compatible server (local Ray by default)")
    try:
        from cluster.tools import serve_cli
    except ImportError as e:  # the serving stack failed to import: say why when `serve` is used
        serve.set_defaults(func=lambda _args, e=e: _fail(f"serving is unavailable: {e}"))
    else:
        serve_cli.add_arguments(serve)
        serve.set_defaults(func=serve_cli.run)

    rb = sub.add_parser("run-batch", help="offline batch inference on an OpenAI Batch file")
    rb.add_argument("-i", "--input", required=True, help="input .jsonl (OpenAI Batch format)")
    rb.add_argument("-o", "--output", required=True, help="output .jsonl")
    rb.add_argument("--model", required=True, help="local Hugging Face model directory")
    rb.add_argument("--served-model-name", default=None, help="the name lines may give as 'model' (or the directory)")
    rb.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    rb.add_argument("--chat-template", default=None, metavar="FILE", help="Jinja chat template instead of the model's")
    rb.add_argument(
        "--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS, help='tool-call format for tool_choice "auto"'
    )
    add_engine_arguments(rb)
    rb.set_defaults(func=_cmd_run_batch)

    bench = sub.add_parser(
        "bench",
        help="load an OpenAI-compatible server with a workload and report latency and throughput",
        description="Sends a workload (../shared/workloads format) to any OpenAI-compatible base URL.",
    )
    from cluster.tools import loadgen

    loadgen.add_arguments(bench)
    bench.set_defaults(func=loadgen.run)

    val = sub.add_parser(
        "validate",
        help="check Ray cluster files, Serve configs and ServeConfigs before deploying them",
        description="Checks each FILE with its own schema (Ray's cluster validation, Serve's schema, shapeserve's "
        "ServeConfig) and, given a cluster file with a config, that every pool fits a node type. Exit status 1 on "
        "any problem.",
    )
    from cluster.tools import validate

    validate.add_arguments(val)
    val.set_defaults(func=validate.run)

    dm = sub.add_parser("demo-model", help="write a small random-weight Llama with a tokenizer")
    dm.add_argument("dir")
    dm.add_argument("--vocab-size", type=int, default=512)
    dm.add_argument("--hidden-size", type=int, default=64)
    dm.add_argument("--intermediate-size", type=int, default=128)
    dm.add_argument("--num-layers", type=int, default=2)
    dm.add_argument("--num-heads", type=int, default=4)
    dm.add_argument("--num-kv-heads", type=int, default=2)
    dm.add_argument("--max-position-embeddings", type=int, default=1024)
    dm.add_argument("--tie-word-embeddings", action="store_true")
    dm.add_argument("--architecture", default="llama", choices=["llama", "mistral", "qwen2"])
    dm.add_argument("--seed", type=int, default=0)
    dm.set_defaults(func=_cmd_demo_model)
    return parser


def _fail(message: str) -> int:
    print(f"shapeserve: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ShapeserveError as e:
        return _fail(e.message)


if __name__ == "__main__":
    sys.exit(main())
