"""``fastdeploy router``: the HTTP front that spreads requests over registered instances."""

from __future__ import annotations

import logging

import typer

from fastdeploy_core.errors import FastDeployError


def router(
    host: str = typer.Option("0.0.0.0", "--host", help="Address to listen on."),
    port: int = typer.Option(9000, "--port", help="HTTP port."),
    splitwise: bool = typer.Option(False, "--splitwise", help="Pair a prefill and a decode instance per request (instances started with --splitwise-role prefill|decode); without it, mixed instances only."),
    policy: str = typer.Option("request_num", "--policy", help="Mixed mode: random | round_robin | power_of_two | request_num | process_tokens | cache_aware."),
    prefill_policy: str = typer.Option("process_tokens", "--prefill-policy", help="Splitwise mode: how the prefill instance is chosen (same names)."),
    decode_policy: str = typer.Option("request_num", "--decode-policy", help="Splitwise mode: how the decode instance is chosen (same names)."),
    request_timeout_secs: float = typer.Option(1800.0, "--request-timeout-secs", help="Longest wait for an instance's next bytes."),
    instance_ttl_secs: float = typer.Option(10.0, "--instance-ttl-secs", help="An instance not heard from for this long is dropped (instances heartbeat every 2 s)."),
    router_secret: str | None = typer.Option(None, "--router-secret", help="Shared secret that signs registrations and pairings (or env FD_ROUTER_SECRET; else derived from the first --api-key); the same on every instance. See docs/security.md."),
    api_key: list[str] | None = typer.Option(None, "--api-key", help="Accepted client API key (repeatable; also env FD_API_KEY); forwarded to the instances, which check it too."),  # noqa: B008
    log_level: str = typer.Option("info", "--log-level", help="debug | info | warning | error."),
) -> None:
    """Start the router."""
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s [%(name)s] %(message)s")
    import uvicorn

    from fastdeploy_core.entrypoints.openai.auth import collect_api_keys
    from fastdeploy_core.router.app import RouterConfig, build_app
    from fastdeploy_core.router.security import require_secret

    keys = collect_api_keys(api_key)
    try:
        secret = require_secret(router_secret, keys, "fastdeploy router")
        config = RouterConfig(secret=secret, host=host, port=port, splitwise=splitwise, policy=policy,
                              prefill_policy=prefill_policy, decode_policy=decode_policy,
                              request_timeout_secs=request_timeout_secs, instance_ttl_secs=instance_ttl_secs,
                              api_keys=keys)
        app = build_app(config)
    except FastDeployError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(2) from None
    uvicorn.run(app, host=host, port=port, log_level=log_level.lower())


def register(app: typer.Typer) -> None:
    """Add ``router`` to the ``fastdeploy`` command line."""
    app.command("router", help="Start the router in front of registered instances (FastDeploy's router).")(router)
