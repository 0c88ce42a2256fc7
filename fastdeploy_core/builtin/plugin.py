"""The core's own hook implementations, registered like any plugin (name ``builtin``)."""

from __future__ import annotations

import importlib

from fastdeploy_core import PLUGIN_API_VERSION
from fastdeploy_core.hookspecs import hookimpl

FD_PLUGIN_API_VERSION = PLUGIN_API_VERSION

#: Modules that each expose ``register(app)`` adding working sub-commands to the CLI.
CORE_COMMAND_MODULES: tuple[str, ...] = (
    "fastdeploy_core.cli.serve", "fastdeploy_core.cli.generate", "fastdeploy_core.cli.bench", "fastdeploy_core.cli.bench_serve",
    "fastdeploy_core.router.cli",
)


@hookimpl
def register_devices(register):
    from fastdeploy_core.builtin.cpu.device import CpuDevice

    register(CpuDevice)


@hookimpl
def register_quantizers(register):
    from fastdeploy_core.quantization import BUILTIN_METHODS

    for name, target in BUILTIN_METHODS.items():
        register(name, target)  # "module:Class", imported when the method is used


#: The core's request-level schedulers, imported when one is selected.
BUILTIN_SCHEDULERS: dict[str, str] = {
    "local": "fastdeploy_core.scheduler.local:LocalScheduler",
    "global": "fastdeploy_core.scheduler.global_scheduler:GlobalScheduler",
}


@hookimpl
def register_schedulers(register):
    for name, target in BUILTIN_SCHEDULERS.items():
        register(name, target)


#: The core's speculative-decoding proposers, imported when one is configured.
BUILTIN_PROPOSERS: dict[str, str] = {
    "ngram": "fastdeploy_core.spec_decode.ngram:NgramProposer",
    "draft_model": "fastdeploy_core.spec_decode.draft_model:DraftModelProposer",
    "mtp": "fastdeploy_core.spec_decode.mtp:MtpProposer",
}


@hookimpl
def register_router_policies(register):
    from fastdeploy_core.router.policies import BUILTIN_POLICIES

    for name, cls in BUILTIN_POLICIES.items():
        register(name, cls)


#: The core's guided-decoding backends, imported when one is chosen (``--guided-decoding-backend``).
BUILTIN_GUIDED_BACKENDS: dict[str, str] = {
    "guidance": "fastdeploy_core.guided.llguidance_backend:LLGuidanceBackend",
}


@hookimpl
def register_proposers(register):
    for name, target in BUILTIN_PROPOSERS.items():
        register(name, target)


@hookimpl
def register_guided_backends(register):
    for name, target in BUILTIN_GUIDED_BACKENDS.items():
        register(name, target)


#: The core's tool-call parsers (``--tool-call-parser``).
BUILTIN_TOOL_PARSERS: dict[str, str] = {
    "hermes": "fastdeploy_core.entrypoints.openai.tool_parsers:HermesToolParser",
    "llama3_json": "fastdeploy_core.entrypoints.openai.tool_parsers:Llama3JsonToolParser",
}


@hookimpl
def register_tool_parsers(register):
    for name, target in BUILTIN_TOOL_PARSERS.items():
        register(name, target)


#: The core's reasoning parsers (``--reasoning-parser``).
BUILTIN_REASONING_PARSERS: dict[str, str] = {
    "deepseek_r1": "fastdeploy_core.entrypoints.openai.reasoning_parsers:DeepSeekR1ReasoningParser",
    "qwen3": "fastdeploy_core.entrypoints.openai.reasoning_parsers:Qwen3ReasoningParser",
}


@hookimpl
def register_reasoning_parsers(register):
    for name, target in BUILTIN_REASONING_PARSERS.items():
        register(name, target)


@hookimpl
def register_commands(app):
    for module_name in CORE_COMMAND_MODULES:
        importlib.import_module(module_name).register(app)
