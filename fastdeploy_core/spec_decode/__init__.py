"""Speculative decoding: proposers (the contract in :mod:`.base`, ``ngram`` in :mod:`.ngram`,
``draft_model`` in :mod:`.draft_model`, ``mtp`` in :mod:`.mtp`).

A proposer guesses the next tokens of decoding requests; the engine's scheduler makes room
for them in the step (:meth:`fastdeploy_core.engine.scheduler.Scheduler.add_drafts`), the
runner has the target score them in the same ragged batch and keeps what the target agrees
with (:func:`fastdeploy_core.executor.sampler.verify_drafts`). Methods are registered through
the ``register_proposers`` hook and looked up here by ``--speculative-config``'s ``method``.

This room sits above the executor (a draft-model proposer drives a runner of its own) and
below the engine, which calls the proposer each step.
"""

from __future__ import annotations

from fastdeploy_core.config import EngineArgs, SpeculativeConfig
from fastdeploy_core.plugins import get_plugin_manager, registered_subclass
from fastdeploy_core.spec_decode.base import DraftRequest, Proposer, ProposerContext

__all__ = ["DraftRequest", "Proposer", "ProposerContext", "build_proposer", "proposer_class"]

#: FastDeploy methods that no package provides here, and why.
UNPROVIDED_FASTDEPLOY_METHODS = {
    "suffix": "suffix decoding is not implemented here",
    "naive": "FastDeploy's no-draft code path has no use here (leave speculative_config out)",
}


def proposer_class(config: SpeculativeConfig, manager=None, args: EngineArgs | None = None) -> type[Proposer]:
    """The class registered as ``config.method``, its settings checked (and the engine's
    settings, ``args``, when given: :meth:`Proposer.check_engine`); ConfigError otherwise."""
    manager = manager or get_plugin_manager()
    cls = registered_subclass(
        manager.proposers, config.method, Proposer, param="speculative_config.method",
        what="speculative decoding method", hook="register_proposers", doc="docs/writing-a-plugin.md",
        unprovided=UNPROVIDED_FASTDEPLOY_METHODS, listed="methods",
    )
    cls.check_config(config)
    if args is not None:
        cls.check_engine(args)
    return cls


def build_proposer(
    args: EngineArgs,
    vocab_size: int,
    max_model_len: int,
    manager=None,
    num_blocks: int | None = None,
    runner=None,
) -> Proposer | None:
    """The proposer ``args.speculative`` asks for, or None when speculative decoding is off.
    ``num_blocks``, ``runner``: the target's KV cache blocks and model runner (see
    :class:`ProposerContext`)."""
    if not args.speculative.enabled:
        return None
    cls = proposer_class(args.speculative, manager, args)
    return cls(args.speculative, ProposerContext(args, vocab_size, max_model_len, num_blocks, manager, runner))
