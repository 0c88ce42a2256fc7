"""The ``fastdeploy`` command line (typer).

Core commands live here (``plugins``, ``env``); commands that need the engine come from
modules listed in :data:`fastdeploy_core.builtin.plugin.CORE_COMMAND_MODULES` and plugins add theirs
through the ``register_commands`` hook.
"""

from __future__ import annotations

import json
import platform
import sys

import typer

from fastdeploy_core import PLUGIN_API_VERSION, __version__

app = typer.Typer(
    name="fastdeploy",
    help="fastdeploy-core: LLM inference and serving on PaddlePaddle, extended by plugins.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain click help: rich's boxed panels cut long flag names (``--engine-worker-qu…``) at
    # 80 columns; click puts a long name on its own line and wraps the help under it.
    rich_markup_mode=None,
)


@app.command("plugins")
def plugins_command(
    as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON."),
    model: str | None = typer.Option(
        None, "--model", help="Also say which implementation would serve this model (path; 'default' = embedded)."
    ),
    model_impl: str = typer.Option("auto", "--model-impl", help="auto | fastdeploy | paddleformers, with --model."),
) -> None:
    """List every plugin, its distribution and version, and what it registered."""
    from fastdeploy_core.plugins import get_plugin_manager

    manager = get_plugin_manager()
    rows = manager.describe()
    serving = _model_serving(manager, model, model_impl) if model else None
    if as_json:
        report = {"plugin_api_version": PLUGIN_API_VERSION, "plugins": rows}
        if serving is not None:
            report["model"] = serving
        typer.echo(json.dumps(report, indent=2))
        return
    if serving is not None:
        typer.echo(
            f"model {serving['path']} ({serving['architecture']}): served by plugin {serving['plugin']}, "
            f"the {serving['impl']} implementation ({serving['target']}): {serving['reason']}"
        )
    for row in rows:
        typer.echo(f"{row['name']}  ({row['distribution']} {row['version']})  {row['status']}")
        if row["status"] == "failed":
            typer.echo(f"    error: {row['error']}")
            continue
        for hook, names in row["registered"].items():
            if names:
                typer.echo(f"    {hook}: {', '.join(names)}")
        if row["gguf_architectures"]:
            typer.echo(f"    gguf architectures: {', '.join(row['gguf_architectures'])}")


def _model_serving(manager, model: str, model_impl: str) -> dict:
    """Which registered implementation serves ``model`` under ``--model-impl``, and why."""
    from fastdeploy_core.errors import FastDeployError
    from fastdeploy_core.loader import resolve_model_source

    try:
        source = resolve_model_source(None if model == "default" else model)
        target, impl, why = manager.model_provider(source.architecture, model_impl, hf_config=source.hf_config)
    except FastDeployError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    name = target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"
    # The plugin that registered the chosen target: its architecture by name, else the catch-all.
    plugin = None
    for registered in (f"{source.architecture} ({impl})", f"* ({impl})"):
        plugin = plugin or next(
            (row["name"] for row in manager.describe() if registered in row.get("registered", {}).get("models", [])),
            None,
        )
    return {
        "path": source.path,
        "architecture": source.architecture,
        "plugin": plugin,
        "impl": impl,
        "target": name,
        "reason": why,
    }


def paddle_info() -> dict:
    """Paddle's version and build flags, without failing when Paddle is missing."""
    try:
        import paddle
    except Exception as exc:  # env must still report the rest
        return {"installed": False, "error": f"{type(exc).__name__}: {exc}"}
    device_mod = paddle.device
    flags = {
        "cuda": paddle.is_compiled_with_cuda(),
        "rocm": paddle.is_compiled_with_rocm(),
        "xpu": paddle.is_compiled_with_xpu(),
        "custom_devices": list(device_mod.get_all_custom_device_type() or []),
    }
    return {"installed": True, "version": paddle.__version__, "commit": paddle.version.commit, "compiled_with": flags}


@app.command("env")
def env_command(as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON.")) -> None:
    """Show Paddle's build, every registered device (available or why not) and the plugins."""
    from fastdeploy_core.plugins import get_plugin_manager

    manager = get_plugin_manager()
    report = {
        "fastdeploy_core": __version__,
        "plugin_api_version": PLUGIN_API_VERSION,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "paddle": paddle_info(),
        "devices": [manager.devices.get(k).describe() for k in sorted(manager.devices.keys())],  # type: ignore[union-attr]
        "plugins": [
            {"name": r["name"], "distribution": r["distribution"], "version": r["version"], "status": r["status"]}
            for r in manager.describe()
        ],
    }
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    typer.echo(
        f"fastdeploy-core {report['fastdeploy_core']} (plugin API {PLUGIN_API_VERSION}), Python {report['python']}"
    )
    typer.echo(f"platform: {report['platform']}")
    pinfo = report["paddle"]
    if pinfo["installed"]:
        typer.echo(f"paddle {pinfo['version']} ({pinfo['commit'][:10]}); compiled with: {pinfo['compiled_with']}")
    else:
        typer.echo(f"paddle: not importable ({pinfo['error']})")
    typer.echo("devices:")
    for dev in report["devices"]:
        state = "available" if dev["available"] else f"unavailable: {dev['reason']}"
        typer.echo(
            f"  {dev['name']:<13} {state}; priority {dev['priority']}, dtypes {','.join(dev['supported_dtypes'])}, "
            f"dist {dev['dist_backend']}, attention {','.join(dev['attention_backends'])}, "
            f"quantization {','.join(dev['quantization_methods']) or '-'}"
        )
    typer.echo("plugins:")
    for plug in report["plugins"]:
        typer.echo(f"  {plug['name']:<13} {plug['distribution']} {plug['version']} ({plug['status']})")


def build_app() -> typer.Typer:
    """The app with every plugin's and the core's extra commands added."""
    from fastdeploy_core.plugins import get_plugin_manager

    get_plugin_manager().register_commands(app)
    return app


def main() -> None:
    """Console-script entry point."""
    build_app()()


if __name__ == "__main__":
    main()
