"""Request-level schedulers: the contract (:mod:`.base`), ``local`` (:mod:`.local`) and the
Redis-backed ``global`` with work stealing across instances (:mod:`.global_scheduler`).

Both built-ins register through the ``register_schedulers`` hook (``builtin/plugin.py``), as a
third party's would; :func:`scheduler_class` finds the one ``--scheduler-name`` asks for.
"""

from __future__ import annotations

import logging

from fastdeploy_core.config import SchedulerConfig
from fastdeploy_core.errors import ConfigError
from fastdeploy_core.plugins import get_plugin_manager, import_target
from fastdeploy_core.scheduler.base import RequestScheduler

logger = logging.getLogger("fastdeploy.scheduler")

#: FastDeploy scheduler names that no package provides here, and what to use instead.
UNPROVIDED_FASTDEPLOY_SCHEDULERS = {
    "splitwise": "prefill/decode disaggregation is not implemented here",
    "dp": "data-parallel serving is not implemented here",
}


def scheduler_class(name: str, manager=None) -> type[RequestScheduler]:
    """The class registered as ``name``; ConfigError listing the registered ones otherwise."""
    manager = manager or get_plugin_manager()
    target = manager.schedulers.get(name)
    if target is None:
        registered = ", ".join(
            f"{key} ({manager.schedulers.entry(key).distribution})" for key in sorted(manager.schedulers.keys())
        )
        why = UNPROVIDED_FASTDEPLOY_SCHEDULERS.get(name)
        hint = (
            f"FastDeploy's {name!r} scheduler: {why}"
            if why
            else "a third-party scheduler is a package registering it through register_schedulers "
            "(docs/scheduler.md); install it, or pick a registered one"
        )
        raise ConfigError(
            f"scheduler_name: no scheduler {name!r} is registered; registered schedulers: "
            f"{registered or 'none'}; {hint}",
            param="scheduler_name",
        )
    cls = import_target(target)
    if not (isinstance(cls, type) and issubclass(cls, RequestScheduler)):
        raise ConfigError(
            f"scheduler_name: {name!r} is registered as {target!r}, which is not a "
            "fastdeploy_core.scheduler.base.RequestScheduler subclass; fix the plugin that registers it",
            param="scheduler_name",
        )
    return cls


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
