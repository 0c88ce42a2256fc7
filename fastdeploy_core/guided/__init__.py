"""Guided decoding: constraints on what a request may generate (JSON schema, regex, choice, grammar).

A request carries a :class:`~fastdeploy_core.guided.params.GuidedDecodingParams` (plain data, it
crosses the process boundary). The engine core hands it to a
:class:`~fastdeploy_core.guided.manager.GuidedDecoder`, which compiles it off the engine loop
(one worker thread, results cached by the constraint's text) with the backend chosen by
``--guided-decoding-backend``; once compiled, each request gets its own matcher whose state
follows the request's generated tokens, and each step the matcher's allowed-token bitmask rides
to the sampler in the request's :class:`~fastdeploy_core.executor.step_io.ScheduledRequest`.

Backends are plugins (``register_guided_backends`` in :mod:`fastdeploy_core.hookspecs`); the
core ships ``guidance`` (the ``llguidance`` library, numpy bitmasks).
"""
