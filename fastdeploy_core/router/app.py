"""The router's HTTP app: registration, introspection and the proxied OpenAI routes.

A routed request is sent to one instance (mixed mode) or to a decode instance with a signed
``X-FD-Disaggregate`` header naming the prefill instance it should take the prompt's KV cache
from (splitwise mode). The answer passes through chunk by chunk. When the chosen instance
cannot be reached, or answers 5xx before anything reached the client, it is dropped (a transport
failure) or skipped (a 5xx) and the request goes to another; once bytes have reached the client
a failure ends the stream with an error event, since a half-sent answer cannot be restarted.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from fastdeploy_core.entrypoints.openai.auth import APIKeyChecker
from fastdeploy_core.entrypoints.openai.errors import error_body
from fastdeploy_core.router import security
from fastdeploy_core.router.instances import DuplicateInstanceError, Instance, InstanceInfo, InstanceRegistry
from fastdeploy_core.router.policies import Policy, RoutedRequest, make_policy

logger = logging.getLogger("fastdeploy.router")

#: Largest registration body; a real one is a few hundred bytes.
MAX_REGISTER_BYTES = 16 * 1024

#: Request headers passed on to the instance (the rest are the router's own business).
FORWARDED_HEADERS = ("authorization", "content-type", "accept", "x-request-id")


@dataclass
class RouterConfig:
    """Everything ``fastdeploy router`` is started with."""

    secret: str
    host: str = "0.0.0.0"
    port: int = 9000
    splitwise: bool = False
    policy: str = "request_num"
    prefill_policy: str = "process_tokens"
    decode_policy: str = "request_num"
    request_timeout_secs: float = 1800.0
    instance_ttl_secs: float = 10.0
    api_keys: list[str] = field(default_factory=list)


@dataclass
class RouterState:
    """The registry, the policies and the counters ``/metrics`` reports."""

    config: RouterConfig
    registry: InstanceRegistry
    policy: Policy
    prefill_policy: Policy
    decode_policy: Policy
    key: bytes
    client: httpx.AsyncClient | None = None
    requests_total: int = 0
    retries_total: int = 0
    failed_total: int = 0
    registrations_refused: int = 0
    routed_per_instance: dict[str, int] = field(default_factory=dict)


def _error(status: int, message: str, error_type: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, error_type, param), status_code=status)


def routing_text(payload: dict[str, Any]) -> str:
    """The text a policy routes on: the chat messages' text in order, or the prompt."""
    if isinstance(payload.get("messages"), list):
        parts: list[str] = []
        for msg in payload["messages"]:
            content = msg.get("content") if isinstance(msg, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(p.get("text", "") for p in content if isinstance(p, dict))
        return "\n".join(parts)
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0]
    if isinstance(prompt, list):
        return " ".join(str(t) for t in prompt)
    return prompt if isinstance(prompt, str) else ""


def build_app(config: RouterConfig) -> FastAPI:
    """The router app; ``app.state.router`` holds its :class:`RouterState`."""
    state = RouterState(
        config=config,
        registry=InstanceRegistry(ttl=config.instance_ttl_secs),
        policy=make_policy(config.policy, "policy"),
        prefill_policy=make_policy(config.prefill_policy, "prefill_policy"),
        decode_policy=make_policy(config.decode_policy, "decode_policy"),
        key=security.router_key(config.secret),
    )
    auth = APIKeyChecker(config.api_keys)

    async def lifespan(app: FastAPI):
        state.client = httpx.AsyncClient(timeout=httpx.Timeout(config.request_timeout_secs, connect=5.0),
                                         limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        yield
        await state.client.aclose()

    app = FastAPI(title="fastdeploy router", lifespan=lifespan)
    app.state.router = state

    @app.post("/register")
    async def register(request: Request) -> Response:
        body = await request.body()
        if len(body) > MAX_REGISTER_BYTES:
            return _error(413, f"a registration is at most {MAX_REGISTER_BYTES} bytes", "invalid_request_error")
        why = security.check_signature(state.key, security.REGISTER_LABEL, body,
                                       request.headers.get(security.TIMESTAMP_HEADER),
                                       request.headers.get(security.SIGNATURE_HEADER))
        if why is not None:
            state.registrations_refused += 1
            status = 401 if why == "missing" else 403
            logger.warning("refused a registration from %s: %s signature", request.client.host if request.client else "?", why)
            return _error(status, f"registration refused: {why} signature; sign it with the router's shared secret "
                          "(--router-secret / FD_ROUTER_SECRET, the same on the router and the instance)",
                          "authentication_error")
        try:
            info = InstanceInfo.model_validate_json(body)
        except ValidationError as exc:
            reasons = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors())
            return _error(400, f"bad registration: {reasons}", "invalid_request_error")
        wanted = ("prefill", "decode") if config.splitwise else ("mixed",)
        if info.role not in wanted:
            mode = "splitwise" if config.splitwise else "mixed"
            return _error(400, f"bad registration: role {info.role!r} does not serve behind a {mode} router, which "
                          f"takes {' and '.join(wanted)} instances", "invalid_request_error", "role")
        if info.role == "prefill" and not info.transfer_endpoint:
            return _error(400, "bad registration: a prefill instance must give its transfer_endpoint",
                          "invalid_request_error", "transfer_endpoint")
        try:
            new = state.registry.register(info)
        except DuplicateInstanceError as exc:
            return _error(400, f"bad registration: {exc}", "invalid_request_error", "role")
        if new:
            logger.info("registered %s instance %s", info.role, info.address)
        return JSONResponse({"status": "ok", "new": new})

    @app.get("/registered")
    async def registered() -> JSONResponse:
        state.registry.expire()
        return JSONResponse({"instances": [inst.as_dict() for inst in state.registry.instances.values()]})

    @app.get("/registered_number")
    async def registered_number() -> JSONResponse:
        return JSONResponse(state.registry.counts())

    @app.get("/health")
    async def health() -> JSONResponse:
        counts = state.registry.counts()
        ready = (counts["prefill"] and counts["decode"]) if config.splitwise else counts["mixed"]
        return JSONResponse({"status": "ok" if ready else "no instances", "instances": counts},
                            status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        lines = ["# TYPE fastdeploy_router:instances gauge"]
        for role, n in state.registry.counts().items():
            lines.append(f'fastdeploy_router:instances{{role="{role}"}} {n}')
        lines.append("# TYPE fastdeploy_router:requests_total counter")
        lines.append(f"fastdeploy_router:requests_total {state.requests_total}")
        lines.append(f"fastdeploy_router:retries_total {state.retries_total}")
        lines.append(f"fastdeploy_router:failed_requests_total {state.failed_total}")
        lines.append(f"fastdeploy_router:registrations_refused_total {state.registrations_refused}")
        lines.append(f"fastdeploy_router:instances_removed_total {state.registry.removed_total}")
        lines.append("# TYPE fastdeploy_router:routed_total counter")
        for key, n in sorted(state.routed_per_instance.items()):
            lines.append(f'fastdeploy_router:routed_total{{instance="{key}"}} {n}')
        for inst in state.registry.instances.values():
            lines.append(f'fastdeploy_router:requests_in_flight{{instance="{inst.key}"}} {inst.in_flight}')
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        auth.check(request.headers.get("authorization")) if auth.enabled else None
        candidates = state.registry.with_role("decode" if config.splitwise else "mixed")
        for inst in candidates:
            try:
                upstream = await state.client.get(inst.info.url + "/v1/models", headers=_forwarded(request))
            except httpx.TransportError:
                state.registry.remove(inst.key)
                continue
            return Response(upstream.content, status_code=upstream.status_code,
                            media_type=upstream.headers.get("content-type"))
        return _no_instance("decode" if config.splitwise else "mixed", None)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _route(state, auth, request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _route(state, auth, request, "/v1/completions")

    return app


def _forwarded(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}


def _no_instance(role: str, last_error: str | None) -> JSONResponse:
    why = f"no live {role} instance is registered"
    if last_error:
        why += f" (the last one tried failed: {last_error})"
    return _error(503, why + "; start one with `fastdeploy serve --router HOST:PORT`", "service_unavailable")


def _pairing(prefill: Instance, decode: Instance) -> str:
    return json.dumps({"prefill": prefill.info.transfer_endpoint, "prefill_address": prefill.key,
                       "protocols": prefill.info.protocols}, separators=(",", ":"))


async def _route(state: RouterState, auth: APIKeyChecker, request: Request, path: str) -> Response:
    from fastdeploy_core.errors import FastDeployError

    if auth.enabled:
        try:
            auth.check(request.headers.get("authorization"))
        except FastDeployError as exc:
            return _error(401, exc.message, "authentication_error")
    body = await request.body()
    try:
        payload = json.loads(body)
    except ValueError:
        payload = None
    if not isinstance(payload, dict):
        return _error(400, "the request body must be a JSON object", "invalid_request_error")
    text = routing_text(payload)
    routed = RoutedRequest(text=text, tokens=max(1, len(text) // 4))
    state.requests_total += 1
    config = state.config
    role = "decode" if config.splitwise else "mixed"
    tried: set[str] = set()
    last_error: str | None = None
    last_response: tuple[int, bytes, str | None] | None = None
    while True:
        candidates = [inst for inst in state.registry.with_role(role) if inst.key not in tried]
        if not candidates:
            state.failed_total += 1
            if last_response is not None:
                status, content, media = last_response
                return Response(content, status_code=status, media_type=media)
            return _no_instance(role, last_error)
        headers = _forwarded(request)
        prefill = None
        if config.splitwise:
            prefills = state.registry.with_role("prefill")
            if not prefills:
                state.failed_total += 1
                return _no_instance("prefill", last_error)
            inst = state.decode_policy.select(candidates, routed)
            prefill = state.prefill_policy.select(prefills, routed)
            headers.update(security.pairing_headers(state.key, _pairing(prefill, inst), body))
            policy = state.decode_policy
        else:
            inst = state.policy.select(candidates, routed)
            policy = state.policy
        tried.add(inst.key)
        _claim(inst, prefill, routed, +1)
        started = time.perf_counter()
        try:
            upstream = await state.client.send(
                state.client.build_request("POST", inst.info.url + path, content=body, headers=headers), stream=True
            )
        except httpx.TransportError as exc:
            _claim(inst, prefill, routed, -1)
            last_error = f"{inst.key}: {type(exc).__name__}: {exc}"
            logger.warning("instance %s failed (%s); dropped, the request goes to another", inst.key, last_error)
            inst.failures += 1
            state.registry.remove(inst.key)
            state.retries_total += 1
            continue
        if upstream.status_code >= 500:
            content = await upstream.aread()
            await upstream.aclose()
            _claim(inst, prefill, routed, -1)
            last_error = f"{inst.key} answered {upstream.status_code}"
            last_response = (upstream.status_code, content, upstream.headers.get("content-type"))
            state.retries_total += 1
            continue
        policy.routed(inst, routed)
        if prefill is not None:
            state.prefill_policy.routed(prefill, routed)
        state.routed_per_instance[inst.key] = state.routed_per_instance.get(inst.key, 0) + 1
        logger.debug("routed to %s in %.1f ms", inst.key, (time.perf_counter() - started) * 1000)
        return StreamingResponse(_relay(state, upstream, inst, prefill, routed, bool(payload.get("stream"))),
                                 status_code=upstream.status_code,
                                 media_type=upstream.headers.get("content-type", "application/json"))


def _claim(inst: Instance, prefill: Instance | None, routed: RoutedRequest, sign: int) -> None:
    inst.in_flight += sign
    inst.tokens_in_flight += sign * routed.tokens
    if sign > 0:
        inst.routed += 1
    if prefill is not None:
        prefill.in_flight += sign
        prefill.tokens_in_flight += sign * routed.tokens
        if sign > 0:
            prefill.routed += 1


async def _relay(state: RouterState, upstream: httpx.Response, inst: Instance, prefill: Instance | None,
                 routed: RoutedRequest, stream: bool):
    """The instance's answer, chunk by chunk; a failure mid-way ends it with an error event."""
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:
        state.failed_total += 1
        logger.warning("instance %s failed mid-answer (%s: %s); dropped", inst.key, type(exc).__name__, exc)
        state.registry.remove(inst.key)
        message = f"the instance serving this request failed mid-answer ({type(exc).__name__}); retry the request"
        error = json.dumps(error_body(message, "service_unavailable"))
        if stream:
            yield f"data: {error}\n\n".encode()
    finally:
        await upstream.aclose()
        _claim(inst, prefill, routed, -1)
