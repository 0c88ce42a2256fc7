"""What chat and text completions share: admission, sampling parameters, streams, usage, logprobs.

Admission has two stages, as in FastDeploy: at most ``--max-concurrency`` generation requests
are in the server at once (the next one gets 429 at once), and at most ``max_num_seqs``
sequences are in the engine; a request waits for engine slots up to ``--max-waiting-time``
seconds (then 503). The waiting time is ``fastdeploy:request_queue_time_seconds``.

A request over the concurrency limit waits a moment (CONCURRENCY_GRACE_SECONDS) for a place
before its 429: a client that closes its streams and reconnects at once would otherwise race the
server noticing the disconnects. A stream gives its place back when its last event is produced,
before the response ends, so the client never sees the end of a stream that still holds a place.

Tokenization, template rendering and the checks that walk the prompt run in worker threads
(:meth:`ServingState.off_loop`): a multi-megabyte prompt must not stall ``/health``.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from fastdeploy_core.engine.core_client import AsyncEngineClient
from fastdeploy_core.engine.sampling_params import SamplingParams
from fastdeploy_core.entrypoints.openai.errors import (
    ClientDisconnected,
    error_body,
    model_not_found,
    queue_timeout,
    too_many_requests,
)
from fastdeploy_core.entrypoints.openai.metrics import ServerMetrics
from fastdeploy_core.entrypoints.openai.protocol import (
    ChatTokenLogprob,
    CompletionLogprobs,
    CompletionTokensDetails,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
    _SamplingFields,
)
from fastdeploy_core.errors import ContextLengthExceededError, FastDeployError, InvalidRequestError, PairingRefusedError
from fastdeploy_core.guided.params import GuidedDecodingParams

logger = logging.getLogger("fastdeploy.serve")


# --- admission --------------------------------------------------------------------------------

#: How long a request over --max-concurrency waits for a place before it gets 429.
CONCURRENCY_GRACE_SECONDS = 0.05


class Admission:
    """Concurrency limit (429) and engine-slot queue with a waiting deadline (503).

    With ``gate_slots=False`` requests are not held for a free engine slot here: a request-level
    scheduler whose queue is shared with peers (``global``) must see every request at once, or
    idle instances never find anything to take.
    """

    def __init__(self, max_concurrency: int, max_slots: int, max_waiting_time: float, gate_slots: bool = True):
        self.max_concurrency = max_concurrency
        self.max_slots = max_slots
        self.gate_slots = gate_slots
        self.max_waiting_time = max_waiting_time
        self.in_flight = 0
        self.free_slots = max_slots
        self._waiters: collections.deque[tuple[int, asyncio.Future]] = collections.deque()
        self._place_waiters: list[asyncio.Future] = []

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    def _grant(self) -> None:
        while self._waiters and self._waiters[0][0] <= self.free_slots:
            slots, fut = self._waiters.popleft()
            if fut.done():
                continue
            self.free_slots -= slots
            fut.set_result(None)

    def _place_freed(self) -> None:
        waiters, self._place_waiters = self._place_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def _wait_for_place(self) -> None:
        deadline = time.monotonic() + CONCURRENCY_GRACE_SECONDS
        while self.in_flight >= self.max_concurrency:
            left = deadline - time.monotonic()
            if left <= 0:
                raise too_many_requests(self.max_concurrency)
            fut = asyncio.get_running_loop().create_future()
            self._place_waiters.append(fut)
            try:
                await asyncio.wait_for(fut, left)
            except asyncio.TimeoutError:
                raise too_many_requests(self.max_concurrency) from None

    async def admit(self, slots: int) -> Lease:
        """Hold one concurrency place and ``slots`` engine slots, or raise 429 / 503."""
        if self.in_flight >= self.max_concurrency:
            await self._wait_for_place()
        if slots > self.max_slots:
            raise InvalidRequestError(
                f"n: {slots} sequences asked for, but the engine runs at most {self.max_slots} (--max-num-seqs)",
                param="n",
            )
        self.in_flight += 1
        lease = Lease(self, slots=0)
        if not self.gate_slots:
            lease.admitted = time.time()
            return lease
        try:
            if not self._waiters and self.free_slots >= slots:
                self.free_slots -= slots
            else:
                fut = asyncio.get_running_loop().create_future()
                entry = (slots, fut)
                self._waiters.append(entry)
                timeout = None if self.max_waiting_time is None or self.max_waiting_time < 0 else self.max_waiting_time
                try:
                    await asyncio.wait_for(asyncio.shield(fut), timeout)
                except (asyncio.TimeoutError, asyncio.CancelledError):
                    if fut.done() and not fut.cancelled():
                        self.free_slots += slots  # granted just as we gave up
                        self._grant()
                    else:
                        fut.cancel()
                        try:
                            self._waiters.remove(entry)
                        except ValueError:
                            pass
                    raise
        except asyncio.TimeoutError:
            lease.release()
            raise queue_timeout(self.max_waiting_time) from None
        except BaseException:
            lease.release()
            raise
        lease.slots = slots
        lease.admitted = time.time()
        return lease


@dataclass
class Lease:
    """What one request holds; :meth:`release` is idempotent."""

    admission: Admission
    slots: int
    admitted: float = 0.0
    released: bool = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.admission.in_flight -= 1
        if self.slots:
            self.admission.free_slots += self.slots
            self.admission._grant()
        self.admission._place_freed()


class LeasedStreamingResponse(StreamingResponse):
    """A streaming response that releases its lease and closes its generator however it ends."""

    def __init__(self, content: AsyncIterator[str], lease: Lease, **kwargs: Any):
        super().__init__(_release_at_end(content, lease), media_type="text/event-stream", **kwargs)
        self._lease = lease
        self._content = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._content.aclose()  # runs its finally: aborts the request if unfinished
            finally:
                self._lease.release()


async def _release_at_end(content: AsyncIterator[str], lease: Lease) -> AsyncIterator[str]:
    # The lease goes back before the response's last frame: a client that saw its stream end may
    # reconnect at once and must find its place free.
    try:
        async for chunk in content:
            yield chunk
    finally:
        lease.release()


# --- the shared state ---------------------------------------------------------------------------


@dataclass
class ServingState:
    """Everything a handler needs; built once by the app's lifespan."""

    engine: AsyncEngineClient
    tokenizer: Any
    served_model_name: str
    model_source: str
    metrics: ServerMetrics
    admission: Admission
    chat_template: str | None = None
    generation_config: dict[str, Any] | None = None
    accepted_model_names: set[str] = field(default_factory=set)
    trust_request_chat_template: bool = False
    policy: str = "fcfs"
    #: The guided-decoding backend class (checks constraints before admission), None when off.
    guided_backend: Any = None
    #: The ``--tool-call-parser`` class, None when none was chosen.
    tool_parser: Any = None
    #: The ``--reasoning-parser`` class, None when none was chosen.
    reasoning_parser: Any = None
    #: A decode instance's key for the router's pairing header (None: the header is not read).
    pairing_key: bytes | None = None
    _longest_token: int = field(default=64, init=False)

    def __post_init__(self) -> None:
        backend = getattr(self.tokenizer, "backend", None)
        if backend is not None:
            self._longest_token = max((len(t) for t in backend.get_vocab(with_added_tokens=True)), default=64)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_prompt_chars(self) -> int:
        """A text longer than this cannot fit into max_model_len tokens, so it is refused before it
        is tokenized: no token covers more than the longest vocabulary entry (twice that, for
        normalizers that shorten text)."""
        return self.max_model_len * self._longest_token * 2

    async def off_loop(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` in a worker thread: tokenizing or rendering a large prompt takes seconds."""
        return await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))

    def check_prompt_chars(self, text: str, param: str) -> None:
        if len(text) > self.max_prompt_chars:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.max_model_len} tokens, but the prompt has "
                f"{len(text)} characters, more than {self.max_model_len} tokens can hold; shorten the prompt",
                param=param,
            )

    def encode_prompt(self, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        """Token ids of a prompt text; too long a text is refused before the tokenizer sees it."""
        self.check_prompt_chars(text, param)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """400 unless every id names a token of the vocabulary."""
        vocab = getattr(self.tokenizer, "vocab_size", None)
        if vocab and any(t < 0 or t >= vocab for t in ids):
            bad = next(t for t in ids if t < 0 or t >= vocab)
            shown = str(bad) if len(str(bad)) <= 24 else f"{str(bad)[:20]}..."
            raise InvalidRequestError(f"{param}: token ids must be in [0, {vocab}), got {shown}", param=param)

    def check_chat_template(self, template: str | None) -> None:
        """A template sent with a request runs code the operator did not choose: refused by default."""
        if template is not None and not self.trust_request_chat_template:
            raise InvalidRequestError(
                "chat_template: this server does not accept chat templates in requests; its operator can "
                "allow them with --trust-request-chat-template",
                param="chat_template",
                code="chat_template_not_allowed",
            )

    def check_priority(self, priority: int) -> None:
        """A priority only orders requests under ``--policy priority``; elsewhere it would be ignored."""
        if priority != 0 and self.policy != "priority":
            raise InvalidRequestError(
                f"priority: got {priority}, but this server schedules {self.policy} (arrival order), so a "
                "priority would be ignored; send 0 or omit it, or start the server with --policy priority",
                param="priority",
            )

    def check_model(self, name: str | None) -> None:
        if name is None or name == "" or name == self.served_model_name or name in self.accepted_model_names:
            return
        raise model_not_found(name, self.served_model_name)

    def check_engine(self) -> None:
        self.engine.check_available()

    # --- sampling parameters ----------------------------------------------------------------

    def check_guided(self, guided: GuidedDecodingParams | None) -> None:
        """400 when the constraint cannot compile (the backend's message) or structured output is off."""
        if guided is None:
            return
        if self.guided_backend is None:
            raise InvalidRequestError(
                "structured output is off on this server (started with --guided-decoding-backend off); "
                "send the request without response_format / guided_* / a forced tool_choice",
                param="response_format",
            )
        self.guided_backend.check(guided)

    def sampling_params(self, req: _SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        guided: GuidedDecodingParams | None = None) -> SamplingParams:
        """SamplingParams from a request (FastDeploy names); bad values raise a 400 naming the field.

        ``guided`` (checked here: slow for big schemas, so call this off the event loop) constrains
        the output; without it the request's own ``response_format`` / ``guided_*`` apply."""
        guided = guided if guided is not None else req.guided_params()
        self.check_guided(guided)
        banned: list[list[int]] = []
        if req.stop_token_ids:
            self.check_token_ids(list(req.stop_token_ids), "stop_token_ids")
        if req.logit_bias:
            self.check_token_ids([int(key) for key in req.logit_bias], "logit_bias")
            for key, bias in req.logit_bias.items():
                if bias > -100:
                    raise InvalidRequestError(
                        "logit_bias: only -100 (ban the token) is supported yet; "
                        f"got {bias} for token {key}",
                        param="logit_bias",
                    )
                banned.append([int(key)])
        params = SamplingParams(
            n=req.n,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=req.repetition_penalty,
            seed=req.seed,
            stop=req.stop_list() or None,
            stop_token_ids=list(req.stop_token_ids) if req.stop_token_ids else None,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens or 0,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            bad_words=list(req.bad_words) if req.bad_words else None,
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos,
            guided_decoding=guided,
        )
        if banned:
            # bad_words become token sequences the way the output processor does it; then add the bans.
            self.engine.output_processor.prepare_sampling_params(params)
            params.bad_words_token_ids = (params.bad_words_token_ids or []) + banned
        return params.with_generation_config_defaults(self.generation_config)

    def check_length(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """400 context_length_exceeded when the prompt (plus max_tokens) does not fit."""
        limit = self.max_model_len
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty after tokenization", param="prompt")
        if n >= limit:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {limit} tokens, but the prompt has {n} tokens "
                "(and at least one token must be generated); shorten the prompt",
                param="messages",
            )
        if params.max_tokens is not None and n + params.max_tokens > limit:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {limit} tokens; the prompt has {n} tokens and "
                f"max_tokens is {params.max_tokens} ({n + params.max_tokens} in total); lower max_tokens "
                "or shorten the prompt",
                param="max_tokens",
            )
        self.check_token_ids(prompt_token_ids, "prompt")

    def new_request_id(self, prefix: str, given: str | None) -> str:
        rid = given or f"{prefix}-{uuid.uuid4().hex}"
        if self.engine.has_request(rid):
            raise InvalidRequestError(f"request_id {rid!r} is already in flight", param="request_id")
        return rid

    # --- running requests -------------------------------------------------------------------

    async def stream_outputs(
        self,
        raw_request: Request | None,
        jobs: list[tuple[str, str | None, list[int], SamplingParams]],
        arrival: float,
        priority: int = 0,
    ) -> AsyncIterator[tuple[int, Any]]:
        """Run ``jobs`` (request_id, prompt, prompt ids, params) in the engine at ``priority`` (lower
        runs first under ``--policy priority``); yield ``(job_index, RequestOutput)`` as they come.
        A client disconnect aborts every job."""
        queue: asyncio.Queue = asyncio.Queue()
        end, gone = object(), object()
        pairing = await self.pairing(raw_request)

        async def pump(k: int, rid: str, prompt: str | None, ids: list[int], params: SamplingParams) -> None:
            try:
                async for out in self.engine.generate(rid, prompt, ids, params, arrival_time=arrival,
                                                     priority=priority, disaggregate=pairing):
                    queue.put_nowait((k, out))
                queue.put_nowait((k, end))
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait((k, exc))

        async def watch() -> None:
            if raw_request is None:
                return
            while True:
                message = await raw_request.receive()
                if message["type"] == "http.disconnect":
                    queue.put_nowait((-1, gone))
                    return

        tasks = [asyncio.create_task(pump(k, *job)) for k, job in enumerate(jobs)]
        watcher = asyncio.create_task(watch())
        remaining = len(jobs)
        try:
            while remaining:
                k, item = await queue.get()
                if item is end:
                    remaining -= 1
                    continue
                if item is gone:
                    logger.info("client disconnected; aborting %s", ", ".join(j[0] for j in jobs))
                    raise ClientDisconnected()
                if isinstance(item, BaseException):
                    raise item
                yield k, item
        finally:
            watcher.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(watcher, *tasks, return_exceptions=True)

    async def pairing(self, raw_request: Request | None) -> dict[str, Any] | None:
        """On a decode instance, the router's pairing of this request with a prefill instance
        (its signature checked against this very body); None when the request carries none (it
        is then served here whole). A pairing that does not verify is a 403."""
        if self.pairing_key is None or raw_request is None:
            return None
        from fastdeploy_core.disaggregation.pairing import (
            PAIRING_HEADER,
            PAIRING_SIGNATURE_HEADER,
            check_pairing,
            parse_pairing,
        )

        header = raw_request.headers.get(PAIRING_HEADER)
        if header is None:
            return None
        why = check_pairing(self.pairing_key, header, raw_request.headers.get(PAIRING_SIGNATURE_HEADER, ""),
                            await raw_request.body())
        if why is None:
            try:
                return parse_pairing(header)
            except ValueError as exc:
                why = str(exc)
        raise PairingRefusedError(f"the router's pairing header was refused ({why}); requests reach a decode "
                                  "instance through `fastdeploy router --splitwise` with the shared secret")

    def record(self, out: Any, arrival: float, admitted: float, success: bool) -> None:
        """Metrics of one finished request output (each choice counts as one sequence)."""
        m = out.metrics
        now = time.time()
        first = getattr(m, "first_token_time", None) if m else None
        for k, choice in enumerate(out.outputs):
            self.metrics.observe_request(
                arrival=arrival,
                admitted=admitted,
                first_token=first,
                finished=(getattr(m, "finish_time", None) or now) if m else now,
                prompt_tokens=len(out.prompt_token_ids),
                generation_tokens=len(choice.token_ids),
                success=success and k == 0,  # one request, however many choices
            )

    # --- output pieces ------------------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]] | None,
                      top_n: int) -> list[ChatTokenLogprob]:
        entries: list[ChatTokenLogprob] = []
        if not logprobs:
            return entries
        for tid, lp in zip(token_ids, logprobs):
            text = self.token_text(tid)
            tops = sorted(lp.items(), key=lambda kv: kv[1], reverse=True)[:top_n] if top_n else []
            entries.append(
                ChatTokenLogprob(
                    token=text,
                    logprob=_finite(lp.get(tid, next(iter(lp.values())))),
                    bytes=list(text.encode("utf-8")),
                    top_logprobs=[
                        TopLogprob(token=(t := self.token_text(i)), logprob=_finite(v), bytes=list(t.encode("utf-8")))
                        for i, v in tops
                    ],
                )
            )
        return entries

    def completion_logprobs(
        self,
        token_ids: list[int],
        logprobs: list[dict[int, float] | None],
        top_n: int,
        text_start: int,
    ) -> CompletionLogprobs:
        result = CompletionLogprobs()
        offset = text_start
        for tid, lp in zip(token_ids, logprobs):
            text = self.token_text(tid)
            result.tokens.append(text)
            result.text_offset.append(offset)
            offset += len(text)
            if lp is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(_finite(lp.get(tid, next(iter(lp.values())))))
            tops = sorted(lp.items(), key=lambda kv: kv[1], reverse=True)[:top_n] if top_n else []
            result.top_logprobs.append({self.token_text(i): _finite(v) for i, v in tops})
        return result


def _finite(x: float) -> float:
    # JSON has no -inf; a token that was filtered out (top-k/top-p) gets the lowest float.
    if math.isnan(x):
        return -9999.0
    return max(float(x), -9999.0)


def usage_for(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
              reasoning_tokens: int | None = None) -> UsageInfo:
    """Usage; ``reasoning_tokens`` (with a reasoning parser) goes into completion_tokens_details."""
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        completion_tokens_details=CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
        if reasoning_tokens is not None
        else None,
    )


def sse(payload: Any) -> str:
    """One server-sent event: ``data: {json}\\n\\n``."""
    if hasattr(payload, "model_dump_json"):
        return f"data: {payload.model_dump_json(exclude_none=True)}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(exc: BaseException) -> str:
    """An error event inside a stream (the status line has been sent already)."""
    if isinstance(exc, FastDeployError):
        body = error_body(exc.message, exc.error_type, exc.param, exc.code)
    else:
        logger.exception("internal error while streaming", exc_info=exc)
        body = error_body(f"internal server error: {type(exc).__name__}: {exc}", "internal_error")
    return f"data: {json.dumps(body)}\n\n"


async def guarded_stream(gen: AsyncIterator[str], on_error: Callable[[BaseException], str]) -> AsyncIterator[str]:
    """Forward ``gen``; a failure becomes an error event and the stream still ends with [DONE]."""
    try:
        async for chunk in gen:
            yield chunk
    except ClientDisconnected:
        return
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - reported in the stream
        yield on_error(exc)
        yield SSE_DONE
    finally:
        await gen.aclose()
