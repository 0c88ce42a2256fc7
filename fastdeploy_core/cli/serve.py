"""``fastdeploy serve``: the OpenAI-compatible server, with FastDeploy's flag names.

Precedence: built-in defaults < the ``--config`` YAML preset < flags given on the command line.
Every flag defaults to "unset" here so that a preset value is never overridden by a default.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import typer

from fastdeploy_core.errors import ConfigError, FastDeployError

logger = logging.getLogger("fastdeploy.serve")

#: ServerConfig keys; every other key belongs to EngineArgs.
SERVER_KEYS = ("host", "port", "metrics_port", "engine_worker_queue_port", "api_key", "max_concurrency",
               "max_waiting_time", "max_request_body_bytes", "protect_metrics", "trust_request_chat_template")



def load_preset(path: str) -> dict[str, Any]:
    """A ``--config`` YAML file as flat keys (``max-num-seqs`` and ``max_num_seqs`` both work)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except OSError as exc:
        raise ConfigError(f"config: cannot read {path}: {exc.strerror}", param="config") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config: {path} is not valid YAML: {exc}", param="config") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config: {path} must hold a mapping of flag names to values", param="config")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def build_configs(preset: dict[str, Any], flags: dict[str, Any]):
    """EngineArgs and ServerConfig from a preset and the explicit flags (flags win)."""
    from fastdeploy_core.config import EngineArgs, ServerConfig, validate_model

    merged = {**preset, **{k: v for k, v in flags.items() if v is not None}}
    if isinstance(merged.get("api_key"), str):
        merged["api_key"] = [merged["api_key"]]
    server_kw = {k: merged.pop(k) for k in SERVER_KEYS if k in merged}
    from fastdeploy_core.entrypoints.openai.auth import collect_api_keys

    server_kw["api_key"] = collect_api_keys(server_kw.get("api_key"))
    server = validate_model(ServerConfig, server_kw)
    if server.protect_metrics and not server.api_key:
        raise ConfigError("--protect-metrics puts /metrics behind the API key, but no key is set; add --api-key "
                          "(or env FD_API_KEY)", param="protect_metrics")
    engine = EngineArgs.create(**merged)
    from fastdeploy_core.scheduler import scheduler_class

    scheduler_class(engine.scheduler.scheduler_name)  # an unknown name fails here, listing the registered ones
    if engine.speculative.enabled:
        from fastdeploy_core.spec_decode import proposer_class

        # likewise an unknown speculative method, a key it does not read, or settings it cannot run with
        proposer_class(engine.speculative, args=engine)
    from fastdeploy_core.entrypoints.openai.reasoning_parsers import reasoning_parser_class
    from fastdeploy_core.entrypoints.openai.tool_parsers import load_tool_parser_plugin, tool_parser_class
    from fastdeploy_core.guided.registry import guided_backend_class

    guided_backend_class(engine.structured.guided_decoding_backend)
    load_tool_parser_plugin(engine.structured.tool_parser_plugin)  # before the name it may register is looked up
    tool_parser_class(engine.structured.tool_call_parser)
    reasoning_parser_class(engine.structured.reasoning_parser)
    return engine, server


def serve(
    ctx: typer.Context,
    model: str | None = typer.Option(None, "--model", help="HF model directory or .gguf file; omit for the embedded default model (SmolLM2-135M-Instruct)."),
    served_model_name: str | None = typer.Option(None, "--served-model-name", help="Model name clients send and see in /v1/models."),
    host: str | None = typer.Option(None, "--host", help="Address to listen on (default: 0.0.0.0)."),
    port: int | None = typer.Option(None, "--port", help="HTTP port (default: 8000)."),
    metrics_port: int | None = typer.Option(None, "--metrics-port", help="Also serve /metrics on this port (always on the main port too)."),
    engine_worker_queue_port: int | None = typer.Option(None, "--engine-worker-queue-port", help="127.0.0.1 port of the link between the API process and the engine core (default: a free port). Any local process can connect to it, so every frame carries a per-launch secret and strangers' frames are dropped (docs/security.md)."),
    max_model_len: int | None = typer.Option(None, "--max-model-len", help="Longest sequence (prompt + output) in tokens (default: the model's)."),
    max_num_seqs: int | None = typer.Option(None, "--max-num-seqs", help="Sequences in one batch (default: 64)."),
    max_num_batched_tokens: int | None = typer.Option(None, "--max-num-batched-tokens", help="Token budget of one engine step."),
    block_size: int | None = typer.Option(None, "--block-size", help="Tokens per KV-cache block (default: 64)."),
    gpu_memory_utilization: float | None = typer.Option(None, "--gpu-memory-utilization", help="Fraction of device memory for weights + KV cache (of RAM on CPU)."),
    num_gpu_blocks_override: int | None = typer.Option(None, "--num-gpu-blocks-override", help="Exact number of KV-cache blocks."),
    kv_cache_memory: str | None = typer.Option(None, "--kv-cache-memory", help="Exact KV-cache size in bytes: 2GiB, 512MiB, 1.5GB or a number (default: the device's rule, logged at start)."),
    kv_cache_dtype: str | None = typer.Option(None, "--kv-cache-dtype", help="auto (float32 K/V, default) | bfloat16 or bf16 (K/V stored rounded to bfloat16: twice the blocks in the same cache memory; attention computed in float32) | int8 (codes plus a scale per token and head)."),
    kv_cache_ratio: float | None = typer.Option(None, "--kv-cache-ratio", help="Share of the KV blocks new prompts may fill while others run; the rest is kept for their output (FastDeploy's prefill/decode split; default 1.0)."),
    tensor_parallel_size: int | None = typer.Option(None, "--tensor-parallel-size", "-tp", help="Ranks to split the model over, one worker process each (on the cpu: the cores split between them)."),
    model_impl: str | None = typer.Option(None, "--model-impl", help="auto | fastdeploy | paddleformers."),
    quantization: str | None = typer.Option(None, "--quantization", help="Quantization method name or FastDeploy JSON."),
    dtype: str | None = typer.Option(None, "--dtype", help="auto | float32 (default: float32 throughout) | bfloat16 (linear layers and the LM head in bfloat16 with float32 sums; embedding, norms and attention stay float32, the KV cache as --kv-cache-dtype says; not with --quantization). float16 is refused."),
    enable_prefix_caching: bool | None = typer.Option(None, "--enable-prefix-caching/--no-enable-prefix-caching", help="Reuse KV blocks of shared prompt prefixes (default: on)."),
    enable_chunked_prefill: bool | None = typer.Option(None, "--enable-chunked-prefill/--no-enable-chunked-prefill", help="Split long prompts over several steps (default: on)."),
    policy: str | None = typer.Option(None, "--policy", help="fcfs (arrival order, default) | priority (a request's \"priority\" field, lower first)."),
    device: str | None = typer.Option(None, "--device", help="Device name or auto."),
    use_cudagraph: bool | None = typer.Option(None, "--use-cudagraph/--no-use-cudagraph", help="Capture decode steps and replay them (default: on; on cpu the kernel calls are replayed from C++)."),
    enforce_eager: bool = typer.Option(False, "--enforce-eager", help="Never capture: run every step's Python forward (vLLM's flag)."),
    speculative_config: str | None = typer.Option(None, "--speculative-config", help='Speculative decoding, FastDeploy JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or \'{"method": "draft_model", "num_speculative_tokens": 3, "quantization": "wint4"}\' ("model": a draft sharing the tokenizer; without it the target\'s own checkpoint, quantized) (methods: `fastdeploy plugins`; greedy and sampled requests speculate with unchanged tokens; those under a grammar decode as usual).'),
    graph_optimization_config: str | None = typer.Option(None, "--graph-optimization-config", help='FastDeploy JSON, e.g. \'{"use_cudagraph": true, "cudagraph_capture_sizes": [1, 2, 4]}\'.'),
    api_key: list[str] | None = typer.Option(None, "--api-key", help="Accepted API key (repeatable); also env FD_API_KEY (comma-separated)."),
    max_concurrency: int | None = typer.Option(None, "--max-concurrency", help="Requests in the server at once; more get 429 (default: 512)."),
    max_waiting_time: float | None = typer.Option(None, "--max-waiting-time", help="Seconds a request may wait for an engine slot before 503; -1 = forever (default: -1)."),
    max_request_body_bytes: int | None = typer.Option(None, "--max-request-body-bytes", help="Largest request body in bytes; larger ones get 413 (default: 4194304, 4 MiB)."),
    protect_metrics: bool | None = typer.Option(None, "--protect-metrics/--no-protect-metrics", help="Put /metrics (and --metrics-port) behind the API key too; /health and /ping stay open (default: off, as Prometheus scrapes expect)."),
    trust_request_chat_template: bool | None = typer.Option(None, "--trust-request-chat-template/--no-trust-request-chat-template", help="Accept a chat_template sent in a request; it runs in a sandbox, bounded in size and time, but is code of the client's choosing (default: refused with 400)."),
    chat_template: str | None = typer.Option(None, "--chat-template", help="Jinja chat template (a file path or the template text)."),
    seed: int | None = typer.Option(None, "--seed", help="Engine seed for unseeded sampling."),
    scheduler_name: str | None = typer.Option(None, "--scheduler-name", help="Request-level scheduler: local (default) | global (Redis, work stealing across instances) | one a plugin registers (`fastdeploy plugins`)."),
    scheduler_max_size: int | None = typer.Option(None, "--scheduler-max-size", help="local: requests its queue holds, more get 503; -1 = no limit (default)."),
    scheduler_ttl: int | None = typer.Option(None, "--scheduler-ttl", help="Seconds a request may wait in the scheduler's queue before it fails (default: 900)."),
    scheduler_host: str | None = typer.Option(None, "--scheduler-host", help="global: Redis host (default: 127.0.0.1)."),
    scheduler_port: int | None = typer.Option(None, "--scheduler-port", help="global: Redis port (default: 6379)."),
    scheduler_db: int | None = typer.Option(None, "--scheduler-db", help="global: Redis database index (default: 0)."),
    scheduler_password: str | None = typer.Option(None, "--scheduler-password", help="global: Redis password; also the signing key when --scheduler-secret is unset."),
    scheduler_secret: str | None = typer.Option(None, "--scheduler-secret", help="global: key signing what instances put in Redis, the same on every instance (or env FD_SCHEDULER_SECRET); see docs/security.md."),
    scheduler_topic: str | None = typer.Option(None, "--scheduler-topic", help="global: instances sharing work use the same topic (default: default)."),
    scheduler_min_load_score: int | None = typer.Option(None, "--scheduler-min-load-score", help="global: queued requests a peer must hold before idle instances steal from it (default: 3)."),
    scheduler_load_shards_num: int | None = typer.Option(None, "--scheduler-load-shards-num", help="global: shards of the load sorted set (default: 1)."),
    scheduler_sync_period: int | None = typer.Option(None, "--scheduler-sync-period", help="global: ms between load reports and steal attempts (default: 5)."),
    scheduler_expire_period: int | None = typer.Option(None, "--scheduler-expire-period", help="global: ms an instance's keep-alive lasts; a silent instance leaves after it (default: 3000)."),
    scheduler_reader_parallel: int | None = typer.Option(None, "--scheduler-reader-parallel", help="global: Redis connections for reading (default: 4)."),
    scheduler_writer_parallel: int | None = typer.Option(None, "--scheduler-writer-parallel", help="global: Redis connections for writing (default: 4)."),
    scheduler_reader_batch_size: int | None = typer.Option(None, "--scheduler-reader-batch-size", help="global: result batches read per round trip (default: 200)."),
    scheduler_writer_batch_size: int | None = typer.Option(None, "--scheduler-writer-batch-size", help="global: outputs per result batch written (default: 200)."),
    splitwise_role: str | None = typer.Option(None, "--splitwise-role", help="mixed (prompts and output, the default) | prefill (computes prompts for decode instances, needs --pd-comm-port) | decode (continues requests whose prompt a prefill instance computed); prefill and decode need --router of a `fastdeploy router --splitwise` (docs/disaggregation.md)."),
    router: str | None = typer.Option(None, "--router", help="HOST:PORT of a `fastdeploy router` to register with (and heartbeat every 2 s)."),
    router_secret: str | None = typer.Option(None, "--router-secret", help="Secret shared with the router: signs this instance's registrations (or env FD_ROUTER_SECRET; else derived from the first --api-key). See docs/security.md."),
    pd_comm_port: int | None = typer.Option(None, "--pd-comm-port", help="prefill instances: the port of the KV channel decode instances connect to (bound on --host; HMAC-sealed with the router secret)."),
    cache_transfer_protocol: str | None = typer.Option(None, "--cache-transfer-protocol", help="prefill/decode instances: KV transports, comma-separated, preferred first: tcp (any host) | shm (same host, shared memory) on the cpu device (default: tcp)."),
    guided_decoding_backend: str | None = typer.Option(None, "--guided-decoding-backend", help="Structured output (response_format json_object/json_schema, guided_json/regex/choice/grammar): auto (default: guidance) | guidance (llguidance) | xgrammar (when a plugin provides it) | off."),
    tool_call_parser: str | None = typer.Option(None, "--tool-call-parser", help="How tool calls are found in replies to tool_choice auto: hermes (<tool_call>{...}</tool_call>, SmolLM2/Qwen) | llama3_json | one a plugin registers. Without it, tool_choice auto answers in text."),
    tool_parser_plugin: str | None = typer.Option(None, "--tool-parser-plugin", help="Python file defining register_tool_parsers(register) that registers more tool-call parsers (ToolParser subclasses) for --tool-call-parser (docs/writing-a-plugin.md, section 4)."),
    reasoning_parser: str | None = typer.Option(None, "--reasoning-parser", help="Return a thinking model's reasoning as reasoning_content beside content: deepseek_r1 (reasoning until </think>) | qwen3 (<think>...</think> at the head of the reply) | one a plugin registers."),
    config: str | None = typer.Option(None, "--config", help="YAML preset of these flags (dash or underscore names); flags given here win."),
    log_level: str = typer.Option("info", "--log-level", help="debug | info | warning | error."),
) -> None:
    """Start the OpenAI-compatible server (engine core in its own process)."""
    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s [%(name)s] %(message)s",
    )
    flags = {
        "model": model, "served_model_name": served_model_name, "host": host, "port": port,
        "metrics_port": metrics_port, "engine_worker_queue_port": engine_worker_queue_port,
        "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens, "block_size": block_size,
        "gpu_memory_utilization": gpu_memory_utilization, "num_gpu_blocks_override": num_gpu_blocks_override,
        "kv_cache_memory": kv_cache_memory, "kv_cache_dtype": kv_cache_dtype,
        "kv_cache_ratio": kv_cache_ratio, "tensor_parallel_size": tensor_parallel_size, "model_impl": model_impl,
        "quantization": quantization, "dtype": dtype, "enable_prefix_caching": enable_prefix_caching,
        "enable_chunked_prefill": enable_chunked_prefill, "policy": policy, "device": device, "api_key": api_key or None,
        "use_cudagraph": use_cudagraph, "enforce_eager": enforce_eager or None,
        "graph_optimization_config": graph_optimization_config, "speculative_config": speculative_config,
        "max_concurrency": max_concurrency, "max_waiting_time": max_waiting_time,
        "max_request_body_bytes": max_request_body_bytes, "protect_metrics": protect_metrics,
        "trust_request_chat_template": trust_request_chat_template,
        "chat_template": _read_template(chat_template), "seed": seed,
        "scheduler_name": scheduler_name, "scheduler_max_size": scheduler_max_size, "scheduler_ttl": scheduler_ttl,
        "scheduler_host": scheduler_host, "scheduler_port": scheduler_port, "scheduler_db": scheduler_db,
        "scheduler_password": scheduler_password, "scheduler_secret": scheduler_secret,
        "scheduler_topic": scheduler_topic, "scheduler_min_load_score": scheduler_min_load_score,
        "scheduler_load_shards_num": scheduler_load_shards_num, "scheduler_sync_period": scheduler_sync_period,
        "scheduler_expire_period": scheduler_expire_period, "scheduler_reader_parallel": scheduler_reader_parallel,
        "scheduler_writer_parallel": scheduler_writer_parallel,
        "scheduler_reader_batch_size": scheduler_reader_batch_size,
        "scheduler_writer_batch_size": scheduler_writer_batch_size,
        "splitwise_role": splitwise_role, "router": router, "router_secret": router_secret,
        "pd_comm_port": pd_comm_port, "cache_transfer_protocol": cache_transfer_protocol,
        "guided_decoding_backend": guided_decoding_backend, "tool_call_parser": tool_call_parser,
        "tool_parser_plugin": tool_parser_plugin, "reasoning_parser": reasoning_parser,
    }
    try:
        preset = load_preset(config) if config else {}
        if "chat_template" in preset:
            preset["chat_template"] = _read_template(preset["chat_template"])
        engine_args, server = build_configs(preset, flags)
        engine_args, heartbeat = splitwise_setup(engine_args, server)
    except FastDeployError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(2) from None
    from fastdeploy_core.entrypoints.openai import api_server

    if heartbeat is not None:
        heartbeat.start()

    try:
        api_server.run_server(engine_args, server, log_level=log_level.lower())
    except FastDeployError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(2) from None


def splitwise_setup(engine_args, server):
    """The heartbeat that registers this instance with ``--router`` (None without one), with the
    router secret resolved (flag, env, API key) and a refusal naming the ways to give one."""
    from fastdeploy_core import __version__
    from fastdeploy_core.router.instances import InstanceInfo
    from fastdeploy_core.router.registration import RouterHeartbeat, advertised_host, parse_address
    from fastdeploy_core.router.security import require_secret

    split = engine_args.splitwise
    if split.router is None:
        return engine_args, None
    given = split.router_secret.get_secret_value() if split.router_secret else None
    secret = require_secret(given, server.api_key, "--router")
    if split.disaggregated:
        # The engine core keys the KV channel from it, and the API process checks pairings with it.
        engine_args = engine_args.model_copy(deep=True)
        engine_args.splitwise.router_secret = secret
        split = engine_args.splitwise
    try:
        router_host, _ = parse_address(split.router)
    except ValueError as exc:
        raise ConfigError(str(exc), param="router") from None
    host = advertised_host(server.host, router_host)
    endpoint = None
    if split.splitwise_role == "prefill":
        endpoint = f"[{host}]:{split.pd_comm_port}" if ":" in host else f"{host}:{split.pd_comm_port}"
    info = InstanceInfo(
        role=split.splitwise_role, host=host, port=server.port, metrics_port=server.metrics_port,
        transfer_endpoint=endpoint, protocols=split.protocols if split.disaggregated else [],
        tp_size=engine_args.parallel.tensor_parallel_size, version=__version__,
        model=engine_args.model.served_model_name or engine_args.model.model,
    )
    local = "127.0.0.1" if server.host in ("0.0.0.0", "") else ("::1" if server.host == "::" else server.host)
    health = f"http://[{local}]:{server.port}/health" if ":" in local else f"http://{local}:{server.port}/health"
    return engine_args, RouterHeartbeat(split.router, info, secret, health)


def _read_template(value: str | None) -> str | None:
    """``--chat-template`` is a path when such a file exists, else the template itself."""
    if value and os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    return value


def register(app: typer.Typer) -> None:
    """Add ``serve`` to the ``fastdeploy`` command line."""
    app.command("serve", help="Start the OpenAI-compatible server (FastDeploy's flags).")(serve)
