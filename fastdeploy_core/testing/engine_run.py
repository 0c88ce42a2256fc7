"""An engine core's requests stepped to the end, as the engine tests do it."""

from __future__ import annotations

from fastdeploy_core.engine.outputs import EngineCoreRequest


def run_to_end(core, requests, abort_after: dict | None = None, key=lambda out: out.request_id,
               outputs: bool = False) -> dict:
    """Submit ``(id, prompt, params)``, step to the end (aborting ``abort_after[id]`` after that
    many steps): {key(output): token ids} (the request id by default; with ``outputs``, the
    ``EngineCoreOutput`` s themselves). Every KV block comes back and the proposer, if any, keeps
    no per-request state."""
    for rid, prompt, params in requests:
        core.add_request(EngineCoreRequest(rid, prompt, params))
    outs: dict = {}
    steps = 0
    while core.has_unfinished_requests():
        steps += 1
        assert steps < 10_000
        for out in core.step():
            if outputs:
                outs.setdefault(key(out), []).append(out)
            else:
                outs.setdefault(key(out), []).extend(out.new_token_ids)
        for rid, when in (abort_after or {}).items():
            if steps == when:
                core.abort_requests([rid])
    bm = core.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
    bm.check_invariants([])
    if getattr(core, "proposer", None) is not None:
        assert not getattr(core.proposer, "_states", None), "the proposer kept a finished request's state"
    return outs
