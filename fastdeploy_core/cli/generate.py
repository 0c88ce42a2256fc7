"""``fastdeploy generate`` (one-shot, batch) and ``fastdeploy chat`` (interactive terminal chat).

Both run the engine in-process. Every engine flag of ``fastdeploy serve`` is accepted after
the command's own options (``--model``, ``--max-model-len 2048``, ``--num-gpu-blocks-override
64``, ``--no-enable-prefix-caching`` …); :func:`engine_args_from_extra` turns them into
:class:`~fastdeploy_core.config.EngineArgs` and unknown ones are a clear error.
"""

from __future__ import annotations

import json
import sys

import typer

from fastdeploy_core.errors import ConfigError, FastDeployError

ENGINE_FLAGS_HELP = (
    "Engine flags of `fastdeploy serve` are accepted too: --model PATH, --max-model-len N, --max-num-seqs N, "
    "--max-num-batched-tokens N, --block-size N, --gpu-memory-utilization F, --num-gpu-blocks-override N, "
    "--[no-]enable-prefix-caching, --[no-]enable-chunked-prefill, --device NAME, --model-impl, --quantization, --dtype, --seed."
)
_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


def parse_engine_flags(tokens: list[str]) -> dict:
    """``["--max-num-seqs", "8", "--no-enable-prefix-caching"]`` -> ``{"max_num_seqs": "8", ...}``.

    Values stay strings; pydantic converts them (and reports bad ones with the flag's name).
    """
    from fastdeploy_core.config import EngineArgs

    fields = EngineArgs.flat_fields()
    flags: dict = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--"):
            raise ConfigError(f"unexpected argument {token!r}; engine flags look like --max-num-seqs 8", param=token)
        name, eq, value = token[2:].partition("=")
        key = name.replace("-", "_")
        if not eq:
            nxt = tokens[i + 1] if i + 1 < len(tokens) else None
            if nxt is not None and not nxt.startswith("--"):
                value, i = nxt, i + 1
            elif key.startswith("no_") and key[3:] in fields:
                key, value = key[3:], "false"
            else:
                value = "true"
        if key not in fields:
            raise ConfigError(f"--{name}: unknown flag; {ENGINE_FLAGS_HELP}", param=key)
        flags[key] = value
        i += 1
    return flags


def engine_args_from_extra(tokens: list[str], **defaults):
    """EngineArgs from pass-through flags; ``defaults`` apply where no flag was given."""
    from fastdeploy_core.config import EngineArgs

    flags = {**{k: v for k, v in defaults.items() if v is not None}, **parse_engine_flags(tokens)}
    return EngineArgs.create(**flags)


def _sampling(max_tokens, temperature, top_p, top_k, seed, stop, n=1, ignore_eos=False):
    from fastdeploy_core.engine.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=list(stop or []) or None,
        n=n,
        ignore_eos=ignore_eos,
    )


def _fail(exc: FastDeployError) -> None:
    typer.echo(f"error: {exc.message}", err=True)
    raise typer.Exit(2)


def generate_command(
    ctx: typer.Context,
    prompt: str | None = typer.Argument(None, help="The prompt (engine flags go after it)."),
    prompts_file: str | None = typer.Option(
        None, "--prompts-file", help="One prompt per line ('-' = stdin), run as a batch."
    ),
    raw: bool = typer.Option(False, "--raw", help="Send the prompt as is instead of as a chat user message."),
    system: str | None = typer.Option(None, "--system", help="System message for chat prompts."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Most tokens to generate per prompt."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    top_p: float | None = typer.Option(None, "--top-p"),
    top_k: int | None = typer.Option(None, "--top-k"),
    seed: int | None = typer.Option(None, "--seed", help="Per-request sampling seed."),
    stop: list[str] | None = typer.Option(None, "--stop", help="Stop string (repeatable)."),  # noqa: B008
    n: int = typer.Option(1, "--n", help="Completions per prompt."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object per prompt."),
) -> None:
    """Generate completions for a prompt (or a file of prompts) with the in-process engine."""
    extra = list(ctx.args)
    if prompt is not None and prompt.startswith("--"):  # click hands an unknown engine flag to PROMPT
        extra.insert(0, prompt)
        prompt = None
    prompts = [prompt] if prompt is not None else []
    if prompts_file == "-":
        prompts += [line.rstrip("\n") for line in sys.stdin if line.strip()]
    elif prompts_file:
        with open(prompts_file, encoding="utf-8") as fh:
            prompts += [line.rstrip("\n") for line in fh if line.strip()]
    if not prompts:
        typer.echo("error: give a prompt or --prompts-file", err=True)
        raise typer.Exit(2)
    try:
        args = engine_args_from_extra(extra)
        params = _sampling(max_tokens, temperature, top_p, top_k, seed, stop, n, ignore_eos)
        from fastdeploy_core.entrypoints.llm import LLM

        llm = LLM.from_engine_args(args)
        if raw:
            outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
        else:
            convs = [
                ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": p}]
                for p in prompts
            ]
            outputs = llm.chat(convs, params, use_tqdm=len(prompts) > 1)
    except FastDeployError as exc:
        _fail(exc)
    for prompt, out in zip(prompts, outputs):
        if as_json:
            typer.echo(
                json.dumps(
                    {
                        "prompt": prompt,
                        "outputs": [
                            {
                                "index": c.index,
                                "text": c.text,
                                "token_ids": c.token_ids,
                                "finish_reason": c.finish_reason,
                            }
                            for c in out.outputs
                        ],
                        "num_prompt_tokens": len(out.prompt_token_ids),
                        "num_cached_tokens": out.num_cached_tokens,
                    },
                    ensure_ascii=False,
                )
            )
        else:
            for c in out.outputs:
                typer.echo(c.text)


CHAT_HINT = "Type a message and press Enter; /reset forgets the conversation; /exit or Ctrl-D quits."


def chat_command(
    ctx: typer.Context,
    system: str | None = typer.Option(None, "--system", help="System message."),
    max_tokens: int = typer.Option(512, "--max-tokens", help="Most tokens per answer."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    top_p: float | None = typer.Option(None, "--top-p"),
    top_k: int | None = typer.Option(None, "--top-k"),
    seed: int | None = typer.Option(None, "--seed"),
) -> None:
    """Interactive chat in the terminal; answers stream as they are generated.

    Type a message and Enter; `/reset` forgets the conversation, `/exit` or Ctrl-D quits.
    """
    try:
        args = engine_args_from_extra(ctx.args)
        params = _sampling(max_tokens, temperature, top_p, top_k, seed, [])
        from fastdeploy_core.entrypoints.llm import LLM

        llm = LLM.from_engine_args(args)
    except FastDeployError as exc:
        _fail(exc)
    history: list[dict] = [{"role": "system", "content": system}] if system else []
    interactive = sys.stdin.isatty()
    typer.echo(CHAT_HINT, err=True)
    while True:
        if interactive:
            typer.echo(">>> ", nl=False)
        line = sys.stdin.readline()
        if not line:
            if interactive:
                typer.echo()  # Ctrl-D leaves the cursor after ">>> "; the shell's prompt gets its own line
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            history = history[:1] if system else []
            typer.echo("(conversation cleared)")
            continue
        history.append({"role": "user", "content": text})
        try:
            answer = stream_answer(llm, history, params)
        except FastDeployError as exc:
            history.pop()
            typer.echo(f"error: {exc.message}", err=True)
            continue
        except KeyboardInterrupt:
            history.pop()
            typer.echo("\n(interrupted)")
            continue
        history.append({"role": "assistant", "content": answer})


def stream_answer(llm, messages: list[dict], params) -> str:
    """Generate one chat answer, printing text deltas as they arrive; returns the full text."""
    engine = llm.engine
    prompt = llm.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, chat_template=llm.engine_args.model.chat_template
    )
    rid = engine.add_request(prompt, params)
    text = ""
    cut = False
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id != rid:
                    continue
                delta = out.outputs[0].delta_text
                if delta:
                    sys.stdout.write(delta)
                    sys.stdout.flush()
                text = out.outputs[0].text
                cut = out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) >= params.max_tokens
    except BaseException:
        engine.abort_request([rid])
        raise
    if cut:  # say so, or a sentence that ends mid-word looks like the model's own answer
        sys.stdout.write(f" [cut at --max-tokens {params.max_tokens}]")
    sys.stdout.write("\n")
    sys.stdout.flush()
    return text


def register(app: typer.Typer) -> None:
    """Add ``generate`` and ``chat`` to the ``fastdeploy`` command line."""
    app.command("generate", context_settings=_PASS_THROUGH, help="Generate completions offline. " + ENGINE_FLAGS_HELP)(
        generate_command
    )
    app.command("chat", context_settings=_PASS_THROUGH, help="Interactive terminal chat. " + ENGINE_FLAGS_HELP)(
        chat_command
    )
