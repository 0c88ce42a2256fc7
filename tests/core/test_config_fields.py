"""Every configuration field is either read by the code it configures or refused.

An option that is validated and then read by nothing lies to its user. The table below names,
for each field of every pydantic section in ``fastdeploy_core/config.py``, where it is read (a
module and the exact attribute access found there) or the value that is refused. The table must
cover exactly the sections' fields: a new field added without handling fails
``test_the_table_covers_exactly_the_config_fields`` until it is read somewhere or refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fastdeploy_core.builtin.cpu.device import CpuDevice
from fastdeploy_core.config import EngineArgs, ServerConfig, check_dtype
from fastdeploy_core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2] / "fastdeploy_core"

RUNNER = "executor/model_runner.py"
CORE = "engine/engine_core.py"
SERVER = "entrypoints/openai/api_server.py"
SERVE = "cli/serve.py"
CONFIG = "config.py"
GLOBAL = "scheduler/global_scheduler.py"


def read(module: str, *accesses: str) -> tuple[str, str, tuple[str, ...]]:
    """The field is read in ``module`` by each of ``accesses`` (source text that must be there)."""
    return ("read", module, accesses)


def refused(value, says: str, param: str | None = None) -> tuple[str, object, str, str | None]:
    """Setting the field to ``value`` raises ConfigError whose message holds ``says``."""
    return ("refused", value, says, param)


#: (section, field) -> how it is honoured. Sections are EngineArgs' attributes plus "server".
FIELDS: dict[tuple[str, str], tuple] = {
    ("model", "model"): read(RUNNER, "resolve_model_source(args.model.model)"),
    ("model", "served_model_name"): read(SERVER, "engine_args.model.served_model_name"),
    ("model", "model_impl"): read(RUNNER, "self.args.model.model_impl"),
    # float32 / auto run; anything else is refused by the runner once the device is known.
    ("model", "dtype"): read(RUNNER, "check_dtype(args.model.dtype, self.device_cls.name"),
    ("model", "max_model_len"): read(RUNNER, "self.max_model_len = args.model.max_model_len"),
    ("model", "chat_template"): read(SERVER, "chat_template=engine_args.model.chat_template"),
    ("model", "seed"): read(CORE, "np.random.SeedSequence(args.model.seed)"),
    ("cache", "block_size"): read(RUNNER, "self.block_size = args.cache.block_size"),
    ("cache", "gpu_memory_utilization"): read(RUNNER, "cache.gpu_memory_utilization"),
    ("cache", "num_gpu_blocks_override"): read(RUNNER, "num_blocks = cache.num_gpu_blocks_override"),
    ("cache", "kv_cache_memory"): read(RUNNER, "budget_bytes = cache.kv_cache_memory"),
    ("cache", "kv_cache_ratio"): read(CORE, "prompt_block_share=args.cache.kv_cache_ratio"),
    ("cache", "enable_prefix_caching"): read(CORE, "args.cache.enable_prefix_caching"),
    ("cache", "kv_cache_dtype"): read(RUNNER, 'args.cache.kv_cache_dtype == "int8"'),
    ("scheduler", "max_num_seqs"): read(CORE, "max_num_seqs=args.scheduler.max_num_seqs"),
    ("scheduler", "max_num_batched_tokens"): read(RUNNER, "return args.scheduler.max_num_batched_tokens"),
    ("scheduler", "enable_chunked_prefill"): read(CORE, "enable_chunked_prefill=args.scheduler.enable_chunked_prefill"),
    ("scheduler", "policy"): read(CORE, "policy=args.scheduler.policy"),
    # Looked up among registered schedulers when the engine starts (fastdeploy_core/scheduler/).
    ("scheduler", "scheduler_name"): read("scheduler/__init__.py", "scheduler_class(config.scheduler_name"),
    ("scheduler", "scheduler_max_size"): read("scheduler/local.py", "self.config.scheduler_max_size"),
    ("scheduler", "scheduler_ttl"): read("scheduler/local.py", "self.config.scheduler_ttl"),
    ("scheduler", "scheduler_host"): read(GLOBAL, "host=config.scheduler_host"),
    ("scheduler", "scheduler_port"): read(GLOBAL, "port=config.scheduler_port"),
    ("scheduler", "scheduler_db"): read(GLOBAL, "db=config.scheduler_db"),
    ("scheduler", "scheduler_password"): read(GLOBAL, "config.scheduler_password.get_secret_value()"),
    ("scheduler", "scheduler_secret"): read("scheduler/signing.py", "config.scheduler_secret"),
    ("scheduler", "scheduler_topic"): read(GLOBAL, 'f"fastdeploy.{config.scheduler_topic}"'),
    ("scheduler", "scheduler_min_load_score"): read(GLOBAL, "self.config.scheduler_min_load_score"),
    ("scheduler", "scheduler_load_shards_num"): read(GLOBAL, "self.config.scheduler_load_shards_num"),
    ("scheduler", "scheduler_sync_period"): read(GLOBAL, "self.config.scheduler_sync_period"),
    ("scheduler", "scheduler_expire_period"): read(GLOBAL, "self.config.scheduler_expire_period"),
    ("scheduler", "scheduler_reader_parallel"): read(GLOBAL, "config.scheduler_reader_parallel"),
    ("scheduler", "scheduler_writer_parallel"): read(GLOBAL, "config.scheduler_writer_parallel"),
    ("scheduler", "scheduler_reader_batch_size"): read(GLOBAL, "self.config.scheduler_reader_batch_size"),
    ("scheduler", "scheduler_writer_batch_size"): read(GLOBAL, "self.config.scheduler_writer_batch_size"),
    # More than 1 runs a worker process per rank (executor/tensor_parallel.py).
    ("parallel", "tensor_parallel_size"): read(CORE, "args.parallel.tensor_parallel_size > 1"),
    ("parallel", "device"): read(RUNNER, "pm.select_device(args.parallel.device)"),
    ("parallel", "attention_backend"): read(RUNNER, "make_ops(args.parallel.attention_backend)"),
    ("quant", "quantization"): read(RUNNER, "args.quant.quantization,"),
    # Looked up among registered proposers when the engine starts (fastdeploy_core/spec_decode/).
    ("speculative", "method"): read("spec_decode/__init__.py", "manager.proposers, config.method"),
    ("speculative", "num_speculative_tokens"): read(CORE, "self.args.speculative.num_speculative_tokens"),
    ("speculative", "disable_by_batch_size"): read(CORE, "limit = self.args.speculative.disable_by_batch_size"),
    ("speculative", "max_ngram_size"): read("spec_decode/ngram.py", "cfg.max_ngram_size"),
    ("speculative", "min_ngram_size"): read("spec_decode/ngram.py", "cfg.min_ngram_size"),
    # Read by the draft_model proposer; refused for methods that do not read them (Proposer.reads).
    ("speculative", "model"): read("spec_decode/draft_model.py", '"model": config.model if config.model is not None'),
    ("speculative", "quantization"): read(
        "spec_decode/draft_model.py", "QuantizationConfig(quantization=config.quantization)"
    ),
    # Read by the mtp proposer (it must equal num_speculative_tokens); refused for the other methods.
    ("speculative", "num_model_steps"): read("spec_decode/mtp.py", "steps = config.num_model_steps"),
    ("graph_opt", "use_cudagraph"): read(CONFIG, "return self.use_cudagraph and not self.enforce_eager"),
    ("graph_opt", "enforce_eager"): read(CONFIG, "return self.use_cudagraph and not self.enforce_eager"),
    ("graph_opt", "cudagraph_capture_sizes"): read(RUNNER, "graph_opt.cudagraph_capture_sizes"),
    ("structured", "guided_decoding_backend"): read(CORE, "guided_backend_class(args.structured.guided_decoding_backend)"),
    ("structured", "tool_call_parser"): read(SERVER, "engine_args.structured.tool_call_parser"),
    ("structured", "tool_parser_plugin"): read(SERVER, "load_tool_parser_plugin(engine_args.structured.tool_parser_plugin)"),
    ("structured", "reasoning_parser"): read(SERVER, "reasoning_parser_class(engine_args.structured.reasoning_parser)"),
    ("graph_opt", "graph_opt_level"): refused(1, "graph_opt_level 1: FastDeploy's static-graph (1) and CINN (2) "
                                                 "levels are not implemented here", "graph_optimization_config"),
    ("splitwise", "router"): read(SERVE, "RouterHeartbeat(split.router, info, secret, health)"),
    ("splitwise", "router_secret"): read(SERVE, "split.router_secret.get_secret_value()"),
    ("splitwise", "splitwise_role"): read("disaggregation/__init__.py", 'split.splitwise_role == "prefill"'),
    ("splitwise", "pd_comm_port"): read("disaggregation/__init__.py", "{split.pd_comm_port}"),
    ("splitwise", "cache_transfer_protocol"): read("disaggregation/__init__.py", "split.protocols"),
    ("server", "host"): read(SERVER, "server.host"),
    ("server", "port"): read(SERVER, "server.port"),
    ("server", "metrics_port"): read(SERVER, "server.metrics_port"),
    ("server", "engine_worker_queue_port"): read(SERVER, "port=server.engine_worker_queue_port"),
    ("server", "api_key"): read(SERVER, "APIKeyChecker(server.api_key)"),
    ("server", "max_concurrency"): read(SERVER, "Admission(server.max_concurrency"),
    ("server", "max_waiting_time"): read(SERVER, "server.max_waiting_time)"),
    ("server", "max_request_body_bytes"): read(SERVER, "server.max_request_body_bytes"),
    ("server", "protect_metrics"): read(SERVER, "if server.protect_metrics"),
    ("server", "trust_request_chat_template"): read(SERVER, "trust_request_chat_template=server.trust_request_chat_template"),
}

#: Where the graph_opt section's ``enabled`` (use_cudagraph and enforce_eager together) is read.
GRAPH_ENABLED_READ = (RUNNER, "if not graph_opt.enabled")


def config_fields() -> set[tuple[str, str]]:
    fields = {
        (section, name)
        for section, info in EngineArgs.model_fields.items()
        for name in info.annotation.model_fields  # type: ignore[union-attr]
    }
    return fields | {("server", name) for name in ServerConfig.model_fields}


def test_the_table_covers_exactly_the_config_fields():
    fields = config_fields()
    missing = sorted(fields - FIELDS.keys())
    stale = sorted(FIELDS.keys() - fields)
    assert not missing, f"config fields neither read nor refused (add each to FIELDS): {missing}"
    assert not stale, f"FIELDS names fields config.py no longer has: {stale}"


def source(module: str) -> str:
    return (ROOT / module).read_text(encoding="utf-8")


@pytest.mark.parametrize("key", [k for k, v in FIELDS.items() if v[0] == "read"], ids="{0[0]}.{0[1]}".format)
def test_read_fields_are_read_where_the_table_says(key):
    _, module, accesses = FIELDS[key]
    text = source(module)
    for access in accesses:
        assert access in text, f"{key}: {module} no longer reads it as {access!r}; read it or refuse it"
    if key[0] == "graph_opt" and module == CONFIG:
        assert GRAPH_ENABLED_READ[1] in source(GRAPH_ENABLED_READ[0])


@pytest.mark.parametrize("key", [k for k, v in FIELDS.items() if v[0] == "refused"], ids="{0[0]}.{0[1]}".format)
def test_refused_fields_raise_a_config_error_saying_so(key):
    _, name = key
    _, value, says, param = FIELDS[key]
    section_only = key[0] == "speculative"  # set only inside --speculative-config's JSON
    given = {"speculative_config": {"method": "ngram", name: value}} if section_only else {name: value}
    with pytest.raises(ConfigError) as info:
        EngineArgs.create(**given)
    assert says in info.value.message
    assert info.value.param == (param or name)
    # The section's default is what runs and is accepted: /config-info shows it, not an effect.
    default = getattr(getattr(EngineArgs(), key[0]), name)
    EngineArgs.create(**({"speculative_config": {name: default}} if section_only else {name: default}))


def test_float16_is_refused_naming_the_dtypes_that_run():
    with pytest.raises(ConfigError) as info:
        check_dtype("float16", CpuDevice.name, tuple(CpuDevice.supported_dtypes))
    assert info.value.param == "dtype"
    assert info.value.message == (
        "dtype: float16 is not supported: device cpu does not support it (its dtypes: float32, bfloat16); "
        "use --dtype float32, bfloat16 or auto"
    )
    # A device that declares float16 is still refused: the engine computes in float32 (bfloat16 linears).
    with pytest.raises(ConfigError, match=r"computes in float32 \(bfloat16: the linear layers\) on every device"):
        check_dtype("float16", "some-gpu", ("bfloat16", "float16", "float32"))
    for runs in ("auto", "float32", "bfloat16"):
        check_dtype(runs, CpuDevice.name, tuple(CpuDevice.supported_dtypes))
        check_dtype(runs, "some-gpu", ("bfloat16", "float16", "float32"))


def test_bfloat16_is_refused_on_a_device_that_does_not_declare_it():
    with pytest.raises(ConfigError) as info:
        check_dtype("bfloat16", "float32-chip", ("float32",))
    assert info.value.message == (
        "dtype: bfloat16 is not supported: device float32-chip does not support it (its dtypes: float32); "
        "use --dtype float32 or auto"
    )


def test_llm_refuses_float16_before_loading_anything():
    """The offline entry point meets the runner's dtype check before any weight is loaded."""
    from fastdeploy_core import LLM

    with pytest.raises(ConfigError, match=r"dtype: float16 is not supported: device cpu does not support it "
                                          r"\(its dtypes: float32, bfloat16\)"):
        LLM(model=None, device="cpu", dtype="float16")


def test_mix_quant_refuses_image_moe_quant_type():
    from fastdeploy_core.errors import QuantizationError
    from fastdeploy_core.quantization.mix_quant import MixQuant

    with pytest.raises(QuantizationError, match="image_moe_quant_type \\('wint4'\\) is not supported"):
        MixQuant.from_config({"dense_quant_type": "wint8",
                              "image_moe_quant_type": "wint4"}, resolver=lambda *a: None)
