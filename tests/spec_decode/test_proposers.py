"""The proposer contract: ngram lookups, the registry behind --speculative-config, refusals."""

from __future__ import annotations

import types

import numpy as np
import pytest

from fastdeploy_core import PLUGIN_API_VERSION
from fastdeploy_core.config import EngineArgs
from fastdeploy_core.errors import ConfigError
from fastdeploy_core.hookspecs import hookimpl
from fastdeploy_core.plugins import PluginManager, load_plugins
from fastdeploy_core.spec_decode import DraftRequest, Proposer, build_proposer, proposer_class
from fastdeploy_core.spec_decode.ngram import NgramProposer, lookup_ngram


def ngram(tokens, k=3, lo=1, hi=3):
    return lookup_ngram(np.asarray(tokens, dtype=np.int64), lo, hi, k)


def test_ngram_takes_the_latest_occurrence_of_the_longest_suffix():
    # suffix [1, 2] occurs twice before; the later one (followed by 7 8 9) wins
    assert ngram([1, 2, 3, 4, 5, 1, 2, 7, 8, 9, 1, 2]) == [7, 8, 9]
    # the 3-token suffix [6, 1, 2] matches first (followed by 3), although [1, 2] alone matches later
    assert ngram([6, 1, 2, 3, 4, 1, 2, 5, 6, 1, 2]) == [3, 4, 1]
    assert ngram([1, 2, 3, 4, 5, 1, 2, 7], k=3) == []  # [7] never occurred before
    assert ngram([4, 4], k=5) == [4]  # the continuation stops at the end of the context
    assert ngram([1, 2, 3, 1, 2, 3], k=2, lo=2, hi=2) == [1, 2]
    assert ngram([1, 2, 9, 2], k=2, lo=2, hi=3) == []  # one-token suffix below min_ngram_size
    assert ngram([5], k=2) == [] and ngram([1, 1, 1], k=0) == []


def test_ngram_proposer_honours_each_requests_budget():
    args = EngineArgs.create(speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                 "min_ngram_size": 1, "max_ngram_size": 2})
    proposer = build_proposer(args, vocab_size=100, max_model_len=64)
    assert isinstance(proposer, NgramProposer)
    got = proposer.propose([
        DraftRequest("a", [1, 2, 3, 4, 5, 6, 1, 2], 4, 4),
        DraftRequest("b", [1, 2, 3, 4, 5, 6, 1, 2], 4, 2),
        DraftRequest("c", [9, 8, 7], 3, 4),
    ])
    assert got == [[3, 4, 5, 6], [3, 4], []]
    assert proposer.describe() == {"method": "ngram", "num_speculative_tokens": 4,
                                   "max_ngram_size": 2, "min_ngram_size": 1}


def test_speculation_off_builds_no_proposer():
    assert build_proposer(EngineArgs.create(), vocab_size=10, max_model_len=10) is None


@pytest.mark.parametrize(
    "spec, says",
    [
        ({"method": "suffix"}, ("speculative_config.method: no speculative decoding method 'suffix' is registered; "
                                "registered methods: draft_model (fastdeploy-core), mtp (fastdeploy-core), ngram "
                                "(fastdeploy-core); FastDeploy's 'suffix': suffix decoding")),
        # mtp is registered, and drafts with the target's layers: without a target runner it cannot
        ({"method": "mtp"}, "'mtp' drafts with the target's own layers and needs the target's model runner"),
        ({"method": "eagle9"}, "a third-party method is a package registering it through register_proposers"),
    ],
)
def test_unregistered_methods_are_refused_listing_the_registered_ones(spec, says):
    args = EngineArgs.create(speculative_config=spec)
    with pytest.raises(ConfigError) as info:
        build_proposer(args, vocab_size=10, max_model_len=10)
    assert says in info.value.message
    assert info.value.param == "speculative_config.method"


@pytest.mark.parametrize(
    "spec, says, param",
    [
        ({"method": "ngram", "num_speculative_tokens": 9}, "speculative_config.num_speculative_tokens: got 9; must be <= 8",
         "speculative_config.num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "must be >= 1", "speculative_config.num_speculative_tokens"),
        ({"method": "ngram", "min_ngram_size": 4, "max_ngram_size": 2}, "min_ngram_size (4) is above max_ngram_size (2)",
         "speculative_config"),
        ({"num_speculative_tokens": 3}, "num_speculative_tokens given without a method", "speculative_config"),
        ({"method": "ngram", "verify_window": 2}, "speculative_config.verify_window: unknown setting",
         "speculative_config.verify_window"),
    ],
)
def test_bad_speculative_settings_name_the_key_and_why(spec, says, param):
    with pytest.raises(ConfigError) as info:
        EngineArgs.create(speculative_config=spec)
    assert says in info.value.message
    assert info.value.param == param


def test_the_setting_round_trips_through_the_flat_form_the_engine_process_gets():
    args = EngineArgs.create(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}',
                             model="/target", quantization="wint8")
    flat = args.flat()
    assert flat["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}
    assert flat["model"] == "/target" and flat["quantization"] == "wint8"  # not shadowed by the section's keys
    assert EngineArgs.create(**flat) == args


class EchoProposer(Proposer):
    """Proposes the last token again, k times (a plugin's proposer for the registry test)."""

    reads = frozenset({"max_ngram_size"})

    def propose(self, requests):
        return [[r.token_ids[-1]] * r.max_tokens for r in requests]


def _manager_with(module) -> PluginManager:
    manager = load_plugins()
    fresh = PluginManager()
    for info in manager.plugins:  # the installed plugins, then the test's
        import importlib

        fresh.add_plugin(importlib.import_module(info.module), info.name, info.distribution, info.version)
    fresh.add_plugin(module, "echo", "fd-echo", "1.0")
    fresh.run_registration_hooks()
    return fresh


def test_a_plugin_registers_a_proposer_through_the_hook():
    module = types.ModuleType("fd_echo")
    module.FD_PLUGIN_API_VERSION = PLUGIN_API_VERSION

    @hookimpl
    def register_proposers(register):
        register("echo", EchoProposer)

    module.register_proposers = register_proposers
    manager = _manager_with(module)
    assert manager.proposers.entry("echo").distribution == "fd-echo"
    args = EngineArgs.create(speculative_config={"method": "echo", "num_speculative_tokens": 2, "max_ngram_size": 3})
    proposer = build_proposer(args, vocab_size=10, max_model_len=10, manager=manager)
    assert proposer.propose([DraftRequest("r", [4, 5], 1, 2)]) == [[5, 5]]
    # a key the method does not read is refused, naming what it reads
    args = EngineArgs.create(speculative_config={"method": "echo", "min_ngram_size": 1})
    with pytest.raises(ConfigError, match=r"speculative_config.min_ngram_size: method 'echo' does not read it "
                                          r"\(it reads max_ngram_size\); drop it"):
        proposer_class(args.speculative, manager)


def test_a_registered_non_proposer_is_refused():
    module = types.ModuleType("fd_bad")
    module.FD_PLUGIN_API_VERSION = PLUGIN_API_VERSION

    @hookimpl
    def register_proposers(register):
        register("bad", dict)

    module.register_proposers = register_proposers
    manager = _manager_with(module)
    args = EngineArgs.create(speculative_config={"method": "bad"})
    with pytest.raises(ConfigError, match="not a fastdeploy_core.spec_decode.base.Proposer subclass"):
        proposer_class(args.speculative, manager)
