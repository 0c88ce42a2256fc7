"""Prefill/decode disaggregation: the role logic and the KV channel between instances.

A ``--splitwise-role prefill`` instance computes prompts for decode instances and writes their
KV blocks into the decode instance's cache (:mod:`.prefill`); a ``--splitwise-role decode``
instance takes the requests the router pairs with a prefill instance, holds blocks for their
prompts, and continues them once the KV and the first token are in (:mod:`.decode`). Messages
go over an HMAC-sealed ZMQ channel keyed from the router's shared secret (:mod:`.channel`); the
bytes go through a transport the device offers (``devices/kv_transport.py``). The router's
pairing header is checked with :mod:`.pairing`. docs/disaggregation.md tells the whole flow.

The engine core process builds the connector with :func:`make_connector` and calls it around
each step; this room imports nothing from ``engine/`` (it drives the engine core through the
methods it is given: ``reserve_remote``, ``admit_remote``, ``add_remote_prompt``,
``abort_requests`` and the scheduler's ``on_finish`` hook).
"""

from __future__ import annotations

from typing import Any


def make_connector(engine: Any, args: Any, bind_host: str) -> Any:
    """The connector of this instance's role (None for ``mixed``)."""
    split = args.splitwise
    if not split.disaggregated:
        return None
    import zmq

    from fastdeploy_core.disaggregation.channel import channel_key
    from fastdeploy_core.errors import ConfigError

    if split.router_secret is None:
        raise ConfigError("a prefill or decode instance needs the router's shared secret to key its KV channel: "
                          "--router-secret or env FD_ROUTER_SECRET (or the same --api-key as the router)",
                          param="router_secret")
    key = channel_key(split.router_secret.get_secret_value())
    if split.splitwise_role == "prefill":
        from fastdeploy_core.disaggregation.prefill import PrefillConnector

        host = bind_host if bind_host not in ("", "::") else "0.0.0.0"
        address = f"tcp://[{host}]:{split.pd_comm_port}" if ":" in host else f"tcp://{host}:{split.pd_comm_port}"
        try:
            return PrefillConnector(engine, key, split.protocols, address, zmq)
        except zmq.ZMQError as exc:
            raise ConfigError(f"pd_comm_port: cannot bind {address} ({exc}); pick a free port",
                              param="pd_comm_port") from None
    from fastdeploy_core.disaggregation.decode import DecodeConnector

    return DecodeConnector(engine, key, split.protocols, zmq)
