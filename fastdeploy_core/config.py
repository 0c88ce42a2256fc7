"""Configuration: pydantic sections and the one ``EngineArgs`` the CLI and ``LLM`` build from.

Field names follow FastDeploy's flags (``--max-num-seqs`` -> ``max_num_seqs``). Validation
errors are turned into :class:`~fastdeploy_core.errors.ConfigError` whose message names the
field, the value given and what is allowed.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from fastdeploy_core.errors import ConfigError

#: The dtype everything but the linear layers computes in, on every device (activations,
#: norms, attention, the KV cache).
ENGINE_DTYPE = "float32"
#: ``--dtype`` values the engine computes in: ``bfloat16`` stores the linear layers' weights (the
#: LM head's too) in bfloat16 and multiplies them by bfloat16-rounded inputs with float32 sums
#: (``quantization/bfloat16.py``); everything else stays float32.
ENGINE_DTYPES = (ENGINE_DTYPE, "bfloat16")


def check_dtype(dtype: str, device_name: str, device_dtypes: tuple[str, ...]) -> None:
    """Refuse a ``dtype`` the engine would not compute in on this device (ConfigError naming the
    device's dtypes). Asked by the model runner once the device is chosen, since the answer
    depends on the device; every entry point builds its engine through that runner."""
    if dtype in ("auto", ENGINE_DTYPE) or (dtype in ENGINE_DTYPES and dtype in device_dtypes):
        return
    if dtype not in device_dtypes:
        why = f"device {device_name} does not support it (its dtypes: {', '.join(device_dtypes)})"
    else:
        why = (
            f"the engine computes in {ENGINE_DTYPE} (bfloat16: the linear layers) on every device for now, "
            f"so {dtype} would not be used"
        )
    runs = [d for d in ENGINE_DTYPES if d == ENGINE_DTYPE or d in device_dtypes]
    raise ConfigError(f"dtype: {dtype} is not supported: {why}; use --dtype {', '.join(runs)} or auto", param="dtype")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


class ModelConfig(_Section):
    """What to load and how to run it."""

    model: str | None = Field(None, description="HF directory or .gguf file; None = embedded default")
    served_model_name: str | None = None
    model_impl: Literal["auto", "fastdeploy", "paddleformers"] = "auto"
    dtype: Literal["float32", "float16", "bfloat16", "auto"] = Field(
        "auto",
        description="auto/float32: float32 throughout; bfloat16: linear layers and the LM head with bfloat16 "
        "weights times bfloat16-rounded inputs, float32 sums (embedding, norms, attention, softmax, KV cache stay "
        "float32), on devices whose dtypes include it, not with --quantization; float16 is refused",
    )
    max_model_len: int | None = Field(None, ge=1, le=1 << 22)
    chat_template: str | None = None
    seed: int = Field(0, ge=0, le=2**63 - 1)


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_BYTE_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_byte_size(value: Any) -> Any:
    """``"2GiB"``, ``"512 MiB"``, ``"1.5GB"``, ``"1073741824"`` -> bytes (an int); other values pass
    through for pydantic to judge. Decimal units (kB, MB, GB, TB) are powers of 1000, binary
    ones (KiB, MiB, GiB, TiB) powers of 1024, as their names say."""
    if not isinstance(value, str):
        return value
    match = _BYTE_SIZE.fullmatch(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _BYTE_UNITS:
        raise ValueError(
            f"got {value!r}; give bytes as a number with an optional unit: 2GiB, 512MiB, 1.5GB, 1073741824"
        )
    return int(float(match.group(1)) * _BYTE_UNITS[unit])


class CacheConfig(_Section):
    """Paged KV cache sizing and prefix caching.

    Size, one of: ``num_gpu_blocks_override`` (blocks), ``kv_cache_memory`` (bytes),
    ``gpu_memory_utilization`` (a share of free device memory), or none: the device's default
    budget (``Device.default_kv_budget``).
    """

    block_size: int = Field(64, ge=1, le=1024)
    gpu_memory_utilization: float | None = Field(
        None, gt=0.0, le=1.0, description="share of free device memory; None: the device's default KV budget"
    )
    num_gpu_blocks_override: int | None = Field(None, ge=1)
    kv_cache_memory: int | None = Field(None, ge=1, description="exact KV cache bytes (2GiB, 512MiB, bytes)")
    kv_cache_ratio: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="FastDeploy's prefill/decode block split: new prompts are admitted while the KV blocks in use "
        "stay within this share of the pool, the rest is kept for running requests' output (None: 1.0)",
    )
    enable_prefix_caching: bool = True
    kv_cache_dtype: Literal["auto", "int8", "bfloat16"] = Field(
        "auto",
        description="auto: float32 K/V; bfloat16 (alias bf16): K/V rounded to bfloat16 on write, half the bytes "
        "per block; int8: codes plus a scale per token and head",
    )

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _bytes(cls, value: Any) -> Any:
        return parse_byte_size(value)

    @field_validator("kv_cache_dtype", mode="before")
    @classmethod
    def _bf16_alias(cls, value: Any) -> Any:
        # vLLM and FastDeploy users write both spellings; one name inside.
        return "bfloat16" if isinstance(value, str) and value.lower() in ("bf16", "bfloat16") else value

    @model_validator(mode="after")
    def _one_size(self) -> CacheConfig:
        given = [
            f"{name}={getattr(self, name)}"
            for name in ("num_gpu_blocks_override", "kv_cache_memory", "gpu_memory_utilization")
            if getattr(self, name) is not None
        ]
        if len(given) > 1:
            raise ValueError(
                f"the KV cache size is given twice ({', '.join(given)}); keep one: blocks "
                "(--num-gpu-blocks-override), bytes (--kv-cache-memory) or a share (--gpu-memory-utilization)"
            )
        return self


class SchedulerConfig(_Section):
    """Batch scheduling inside one engine and the request-level scheduler around it."""

    max_num_seqs: int = Field(64, ge=1, le=65536)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    enable_chunked_prefill: bool = True
    policy: Literal["fcfs", "priority"] = "fcfs"
    # The request-level scheduler (fastdeploy_core/scheduler/): which one, and its settings under
    # FastDeploy's flag names. The name is looked up among registered schedulers when the engine
    # starts (plugins register more); each scheduler class lists the settings it reads, so the
    # others given with it are named in a warning.
    scheduler_name: str = Field("local", min_length=1)
    scheduler_max_size: int = Field(-1, ge=-1, description="queued requests the local scheduler holds; -1 = no limit")
    scheduler_ttl: int = Field(900, ge=1, description="seconds a request may wait in a scheduler queue")
    scheduler_host: str = "127.0.0.1"
    scheduler_port: int = Field(6379, ge=1, le=65535)
    scheduler_db: int = Field(0, ge=0)
    scheduler_password: SecretStr | None = Field(None, description="Redis AUTH password")
    scheduler_secret: SecretStr | None = Field(
        None, description="key that signs what instances put in Redis (else env FD_SCHEDULER_SECRET, else the password)"
    )
    scheduler_topic: str = Field("default", min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")
    scheduler_min_load_score: int = Field(3, ge=1, description="queued requests a peer must hold to be stolen from")
    scheduler_load_shards_num: int = Field(1, ge=1, le=1024)
    scheduler_sync_period: int = Field(5, ge=1, le=10000, description="ms between load reports / steal attempts")
    scheduler_expire_period: int = Field(3000, ge=100, description="ms an instance's keep-alive lasts")
    scheduler_reader_parallel: int = Field(4, ge=1, le=64)
    scheduler_writer_parallel: int = Field(4, ge=1, le=64)
    scheduler_reader_batch_size: int = Field(200, ge=1)
    scheduler_writer_batch_size: int = Field(200, ge=1)


class ParallelConfig(_Section):
    """Tensor parallelism and device choice.

    ``tensor_parallel_size`` > 1 runs one worker process per rank (see
    ``fastdeploy_core/executor/tensor_parallel.py``); whether the model's heads split over that
    many ranks is checked when the ranks build it.
    """

    tensor_parallel_size: int = Field(1, ge=1, le=64)
    device: str = "auto"
    attention_backend: str | None = None



class QuantizationConfig(_Section):
    """``--quantization NAME`` or a FastDeploy JSON string (``mix_quant`` etc.)."""

    quantization: str | None = None

    def parsed(self) -> dict | None:
        """The method as a dict (``{"quantization": name, ...}``) or None."""
        if not self.quantization:
            return None
        text = self.quantization.strip()
        if text.startswith(("{", "[")):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"quantization: {text!r} is not valid JSON ({exc.msg} at column {exc.colno}); "
                    'pass a method name such as "wint8" or a JSON object',
                    param="quantization",
                ) from None
            if not isinstance(value, dict):
                raise ConfigError("quantization JSON must be an object", param="quantization")
            return value
        return {"quantization": text}


class SpeculativeConfig(_Section):
    """Speculative decoding: FastDeploy's ``--speculative-config`` JSON keys.

    ``method`` names a proposer registered through the ``register_proposers`` hook (the core
    registers ``ngram``, ``draft_model`` and ``mtp``); it is looked up when the engine starts, like
    ``--scheduler-name``, so a plugin's proposer is configured the same way. ``None`` (the
    default) decodes one token per step. A key the chosen method does not read (``model`` for
    ``ngram``) is refused when the engine starts (``Proposer.reads``); the other keys of
    FastDeploy's section (``mtp_strategy``, ``verify_window``, ``suffix_*``, ...) are unknown
    settings here.
    """

    method: str | None = Field(
        None, min_length=1, description="registered proposer name: ngram, draft_model or mtp (or a plugin's)"
    )
    num_speculative_tokens: int = Field(
        1, ge=1, le=8, description="draft tokens proposed per step for each speculating request"
    )
    disable_by_batch_size: int | None = Field(
        None, ge=1, description="no drafts in a step with more running requests than this (vLLM's name): "
        "a large batch is compute-bound and gains nothing from speculation; None speculates at any size",
    )
    max_ngram_size: int = Field(5, ge=1, le=64, description="ngram: the longest suffix looked up in the context")
    min_ngram_size: int = Field(2, ge=1, le=64, description="ngram: the shortest suffix looked up")
    model: str | None = Field(
        None,
        description="draft_model: the draft's checkpoint (HF directory or .gguf) sharing the target's vocabulary; "
        "None: the target's own checkpoint (a self-draft, which needs quantization)",
    )
    quantization: str | None = Field(
        None, description='draft_model: how the draft\'s weights are quantized (e.g. "wint4", "wint8"); None: as stored'
    )
    num_model_steps: int | None = Field(
        None, ge=1, le=8, description="mtp (FastDeploy's key): MTP steps run per proposal; the one MTP layer is "
        "chained once per draft token, so it must equal num_speculative_tokens; None: num_speculative_tokens",
    )

    @model_validator(mode="after")
    def _consistent(self) -> SpeculativeConfig:
        if self.min_ngram_size > self.max_ngram_size:
            raise ValueError(
                f"min_ngram_size ({self.min_ngram_size}) is above max_ngram_size ({self.max_ngram_size}); "
                "the ngram proposer looks up suffixes from max_ngram_size down to min_ngram_size tokens"
            )
        if self.method is None:
            fields = type(self).model_fields
            changed = sorted(k for k in self.model_fields_set if getattr(self, k) != fields[k].default)
            if changed:
                raise ValueError(
                    f"{', '.join(changed)} given without a method: speculative decoding is off; add "
                    '"method" (e.g. "ngram") or drop the other keys'
                )
        return self

    @property
    def enabled(self) -> bool:
        return self.method is not None


class GraphOptConfig(_Section):
    """Captured decode steps: FastDeploy's ``--graph-optimization-config`` JSON keys and
    ``--use-cudagraph``, vLLM's ``--enforce-eager``. Each batch size in the capture list is
    recorded on its first decode-only step and replayed after (on the cpu device: the kernel
    calls, see ``fastdeploy_core/executor/decode_graph.py``)."""

    use_cudagraph: bool = True
    cudagraph_capture_sizes: list[int] | None = Field(None, description="None: every batch size up to max_num_seqs")
    enforce_eager: bool = False
    graph_opt_level: int = Field(0, description="static-graph conversion (FastDeploy levels 1-2) is not implemented")

    @model_validator(mode="after")
    def _sizes(self) -> GraphOptConfig:
        if self.graph_opt_level != 0:
            raise ValueError(
                f"graph_opt_level {self.graph_opt_level}: FastDeploy's static-graph (1) and CINN (2) levels are "
                "not implemented here; use 0 (decode steps are still captured while use_cudagraph is on)"
            )
        for size in self.cudagraph_capture_sizes or ():
            if size < 1:
                raise ValueError(f"cudagraph_capture_sizes: {size} is not a batch size; give sizes of 1 or more")
        return self

    @property
    def enabled(self) -> bool:
        return self.use_cudagraph and not self.enforce_eager


class SplitwiseConfig(_Section):
    """The router an instance registers with, and its prefill/decode role (docs/disaggregation.md).

    ``router`` is the ``host:port`` of a ``fastdeploy router`` to register with;
    ``router_secret`` signs the registration and keys the prefill/decode channel. ``mixed``
    computes prompts and their output; a ``prefill`` instance computes prompts for decode
    instances and writes their KV blocks into them through the channel it binds on
    ``pd_comm_port``; a ``decode`` instance takes the requests the router pairs with a prefill
    instance and continues them. ``cache_transfer_protocol`` lists the KV transports this
    instance offers (prefill) or prefers (decode), first preferred; the device must offer each
    (``Device.kv_transports``; checked when the engine starts).
    """

    splitwise_role: Literal["mixed", "prefill", "decode"] = "mixed"
    router: str | None = Field(None, description="HOST:PORT of the router to register with")
    router_secret: SecretStr | None = Field(
        None, description="shared secret of the router and the instances (else FD_ROUTER_SECRET, else the API key)"
    )
    pd_comm_port: int | None = Field(None, ge=1, le=65535, description="port a prefill instance serves KV on")
    cache_transfer_protocol: str = Field("tcp", description="comma-separated KV transports, preferred first")

    @field_validator("cache_transfer_protocol")
    @classmethod
    def _protocol(cls, value: str) -> str:
        names = [p.strip() for p in value.split(",")]
        if not value.strip() or any(not re.fullmatch(r"[a-z0-9_]+", p) for p in names) or len(set(names)) != len(names):
            raise ValueError(f"{value!r}: give distinct transport names separated by commas, e.g. tcp or shm,tcp")
        return ",".join(names)

    @property
    def protocols(self) -> list[str]:
        return self.cache_transfer_protocol.split(",")

    @property
    def disaggregated(self) -> bool:
        return self.splitwise_role != "mixed"

    @model_validator(mode="after")
    def _role(self) -> SplitwiseConfig:
        role = self.splitwise_role
        if role == "prefill" and self.pd_comm_port is None:
            raise ValueError("splitwise_role prefill needs --pd-comm-port (the port decode instances reach its KV "
                             "channel on)")
        if role != "prefill" and self.pd_comm_port is not None:
            raise ValueError(f"pd_comm_port: only prefill instances bind it, this one is {role} (drop --pd-comm-port)")
        if role == "mixed" and "cache_transfer_protocol" in self.model_fields_set and self.protocols != ["tcp"]:
            raise ValueError("cache_transfer_protocol: a mixed instance moves no KV cache; give it with "
                             "--splitwise-role prefill or decode, or drop it")
        if role != "mixed" and self.router is None:
            raise ValueError(f"splitwise_role {role} needs --router HOST:PORT: prefill and decode instances are "
                             "paired per request by `fastdeploy router --splitwise`")
        return self


class StructuredOutputConfig(_Section):
    """Structured output and tool calling (FastDeploy's flag names).

    ``guided_decoding_backend`` names a registered backend (``auto`` prefers ``guidance``; ``off``
    refuses constrained requests); ``tool_call_parser`` a registered tool-call parser, which the
    API server uses to find the tool calls in the text of ``tool_choice: auto`` replies;
    ``tool_parser_plugin`` a Python file that registers more tool-call parsers (FastDeploy's
    flag); ``reasoning_parser`` a registered reasoning parser, which splits a chat reply into
    ``reasoning_content`` and ``content``.
    """

    guided_decoding_backend: str = Field("auto", min_length=1)
    tool_call_parser: str | None = None
    tool_parser_plugin: str | None = None
    reasoning_parser: str | None = None


class ServerConfig(_Section):
    """The HTTP server."""

    host: str = "0.0.0.0"
    port: int = Field(8000, ge=1, le=65535)
    metrics_port: int | None = Field(None, ge=1, le=65535)
    engine_worker_queue_port: int | None = Field(
        None, ge=1, le=65535,
        description="127.0.0.1 port of the API/engine-core link (free port if unset); frames are HMAC-checked",
    )
    api_key: list[str] = Field(default_factory=list)
    max_concurrency: int = Field(512, ge=1)
    max_waiting_time: float = Field(-1, description="seconds a request may wait; -1 = forever")
    max_request_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="larger bodies get 413")
    protect_metrics: bool = Field(False, description="/metrics needs the API key too")
    trust_request_chat_template: bool = Field(False, description="accept a chat_template sent in a request")


class EngineArgs(_Section):
    """Every engine setting, grouped in sections; built from flat keys by :meth:`create`.

    ``EngineArgs.create(max_num_seqs=8, block_size=32)`` routes each flat key (a FastDeploy
    flag name with ``_``) to the one section that owns it, so the CLI and ``LLM(**kwargs)``
    share one path. Errors raise ConfigError naming the field, the value and the range.
    """

    model: ModelConfig = Field(default_factory=ModelConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    quant: QuantizationConfig = Field(default_factory=QuantizationConfig)
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    graph_opt: GraphOptConfig = Field(default_factory=GraphOptConfig)
    splitwise: SplitwiseConfig = Field(default_factory=SplitwiseConfig)
    structured: StructuredOutputConfig = Field(default_factory=StructuredOutputConfig)

    @model_validator(mode="after")
    def _consistent(self) -> EngineArgs:
        sched, model = self.scheduler, self.model
        if (
            sched.max_num_batched_tokens is not None
            and model.max_model_len is not None
            and not sched.enable_chunked_prefill
            and sched.max_num_batched_tokens < model.max_model_len
        ):
            raise ValueError(
                f"max_num_batched_tokens ({sched.max_num_batched_tokens}) is below max_model_len "
                f"({model.max_model_len}) with chunked prefill off: a long prompt could never be "
                "scheduled; raise max_num_batched_tokens or enable chunked prefill"
            )
        if self.splitwise.disaggregated and sched.scheduler_name != "local":
            raise ValueError(
                f"scheduler_name {sched.scheduler_name!r} with splitwise_role {self.splitwise.splitwise_role}: a "
                "prefill/decode instance takes its requests from the router's pairing, not a shared queue; use "
                "--scheduler-name local"
            )
        if self.splitwise.disaggregated and self.parallel.tensor_parallel_size > 1:
            raise ValueError(
                f"tensor_parallel_size {self.parallel.tensor_parallel_size} with splitwise_role "
                f"{self.splitwise.splitwise_role}: moving a prompt's KV cache between instances is implemented for one "
                "rank per instance (each rank's share of the KV heads would have to reach its peer rank); use "
                "--tensor-parallel-size 1 on prefill and decode instances"
            )
        return self

    @classmethod
    def flat_fields(cls) -> dict[str, str]:
        """Flat key -> section name, for every setting."""
        owners: dict[str, str] = {}
        for section, info in cls.model_fields.items():
            if section in _SECTION_ONLY_FLAGS:
                continue
            for key in info.annotation.model_fields:  # type: ignore[union-attr]
                owners[key] = section
        owners["speculative_config"] = "speculative"
        owners["graph_optimization_config"] = "graph_opt"
        return owners

    @classmethod
    def create(cls, **kwargs: Any) -> EngineArgs:
        """Validate flat ``kwargs``; unknown keys and bad values raise ConfigError."""
        owners = cls.flat_fields()
        grouped: dict[str, dict[str, Any]] = {name: {} for name in cls.model_fields}
        unknown = [k for k in kwargs if k not in owners]
        if unknown:
            raise ConfigError(
                "; ".join(f"{k}: unknown setting (given {kwargs[k]!r}); check the spelling" for k in unknown),
                param=unknown[0],
            )
        for key, value in kwargs.items():
            if key in ("speculative_config", "graph_optimization_config"):
                if isinstance(value, str):
                    try:
                        value = json.loads(value)
                    except json.JSONDecodeError:
                        raise ConfigError(f"{key}: {value!r} is not valid JSON", param=key) from None
                if value is not None and not isinstance(value, dict):
                    raise ConfigError(f"{key}: expected a JSON object, got {value!r}", param=key)
                grouped[owners[key]].update(value or {})
            else:
                grouped[owners[key]][key] = value
        try:
            return cls(**grouped)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, flat=True), param=_first_field(exc, flat=True)) from None

    def flat(self) -> dict[str, Any]:
        """The inverse of :meth:`create`: every setting under its flat name."""
        out: dict[str, Any] = {}
        for section in type(self).model_fields:
            if section in _SECTION_ONLY_FLAGS:
                value = getattr(self, section)
                out[_SECTION_ONLY_FLAGS[section]] = value.model_dump(include=value.model_fields_set) or None
            else:
                out.update(getattr(self, section).model_dump())
        return out


#: Sections reachable only through their JSON flag: their keys (``model``, ``quantization``)
#: would collide with other sections' flat names.
_SECTION_ONLY_FLAGS = {"speculative": "speculative_config"}

#: Sections set as one JSON object by a flag of their own.
_JSON_FLAGS = {"speculative": "speculative_config", "graph_opt": "graph_optimization_config"}


def validate_model(cls: type[BaseModel], data: dict[str, Any]) -> BaseModel:
    """Build ``cls`` from ``data``; pydantic errors become one ConfigError with every problem."""
    try:
        return cls(**data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc), param=_first_field(exc)) from None


def _field_name(loc: tuple, flat: bool) -> str:
    parts = [str(p) for p in loc]
    if flat and len(parts) > 1 and parts[0] in _SECTION_ONLY_FLAGS:
        parts = [_SECTION_ONLY_FLAGS[parts[0]], *parts[1:]]  # a key inside the JSON flag
    elif flat and len(parts) > 1:
        parts = parts[1:]  # drop the section: users wrote the flat flag name
    elif flat and parts and parts[0] in _JSON_FLAGS:
        parts = [_JSON_FLAGS[parts[0]]]  # a whole section set by one JSON flag: name the flag
    return ".".join(parts) or "(config)"


def _first_field(exc: ValidationError, flat: bool = False) -> str | None:
    for err in exc.errors():
        if err.get("loc"):
            return _field_name(err["loc"], flat)
    return None


def format_validation_error(exc: ValidationError, flat: bool = False) -> str:
    """One line per problem: ``field: got VALUE; must be ...``."""
    lines = []
    for err in exc.errors():
        field = _field_name(err.get("loc", ()), flat)
        kind = err.get("type", "")
        given = err.get("input")
        ctx = err.get("ctx") or {}
        if kind == "extra_forbidden":
            lines.append(f"{field}: unknown setting (given {given!r}); check the spelling")
            continue
        if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
            bound = next(iter(ctx.values()))
            op = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}[kind]
            lines.append(f"{field}: got {given!r}; must be {op} {bound}")
            continue
        if kind == "literal_error":
            lines.append(f"{field}: got {given!r}; must be one of {ctx.get('expected')}")
            continue
        msg = err.get("msg", "invalid value")
        if kind == "value_error":
            lines.append(f"{field}: {msg.removeprefix('Value error, ')}")
        else:
            lines.append(f"{field}: got {given!r}; {msg}")
    return "; ".join(lines)
