"""Request-level schedulers: the contract (:mod:`.base`), ``local`` (:mod:`.local`) and the
Redis-backed ``global`` with work stealing across instances (:mod:`.global_scheduler`).

Both built-ins register through the ``register_schedulers`` hook (``builtin/plugin.py``), as a
third party's would; :func:`scheduler_class` finds the one ``--scheduler-name`` asks for.
"""

from __future__ import annotations

import logging

from fastdeploy_core.config import SchedulerConfig
from fastdeploy_core.plugins import get_plugin_manager, registered_subclass
from fastdeploy_core.scheduler.base import RequestScheduler

logger = logging.getLogger("fastdeploy.scheduler")

#: FastDeploy scheduler names that no package provides here, and what to use instead.
UNPROVIDED_FASTDEPLOY_SCHEDULERS = {
    "splitwise": "prefill/decode disaggregation through Redis (FastDeploy's deprecated path) is not implemented here; pair instances with `fastdeploy router --splitwise` and --splitwise-role prefill/decode",
    "dp": "data-parallel serving is not implemented here",
}


def scheduler_class(name: str, manager=None) -> type[RequestScheduler]:
    """The class registered as ``name``; ConfigError listing the registered ones otherwise."""
    manager = manager or get_plugin_manager()
    return registered_subclass(
        manager.schedulers, name, RequestScheduler, param="scheduler_name", what="scheduler",
        hook="register_schedulers", doc="docs/scheduler.md", unprovided=UNPROVIDED_FASTDEPLOY_SCHEDULERS,
        unprovided_label="scheduler",
    )


def check_scheduler(config: SchedulerConfig, manager=None) -> type[RequestScheduler]:
    """Resolve ``--scheduler-name``, warn about settings it ignores, and run its preflight check."""
    cls = scheduler_class(config.scheduler_name, manager)
    ignored = cls.ignored_settings(config)
    if ignored:
        logger.warning(
            "--scheduler-name %s ignores %s (they apply to other schedulers, e.g. global)",
            config.scheduler_name,
            ", ".join("--" + key.replace("_", "-") for key in ignored),
        )
    cls.preflight(config)
    return cls
