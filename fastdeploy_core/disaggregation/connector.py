"""What a prefill and a decode instance's connectors share: the sealed channel, the engine's cache as
host views (and what must agree with the peer's), the transports, the counters /metrics shows."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from fastdeploy_core.devices.kv_transport import block_nbytes, cache_signature, host_views
from fastdeploy_core.disaggregation.channel import Channel


class Connector(ABC):
    """The common part of :class:`~fastdeploy_core.disaggregation.prefill.PrefillConnector` and
    :class:`~fastdeploy_core.disaggregation.decode.DecodeConnector`."""

    role = ""

    def __init__(self, engine: Any, key: bytes, protocols: list[str], zmq: Any, send_label: bytes, recv_label: bytes):
        self.engine = engine
        self.zmq = zmq
        self.ctx = zmq.Context.instance()
        self.channel = Channel(key, send_label, recv_label)
        device = engine.runner.device_cls
        self.transports = {name: device.make_kv_transport(name) for name in protocols}
        self.views = host_views(engine.runner.kv_caches)
        self.signature = cache_signature(self.views)
        self.block_bytes = block_nbytes(self.views)
        self.block_size = engine.block_manager.block_size
        self.completed = 0
        self.failed = 0
        #: Whether a message changed what :meth:`stats` reports since the core last sent them.
        self.dirty = False

    @abstractmethod
    def in_flight(self) -> int:
        """Transfers under way."""

    def stats(self) -> dict[str, Any]:
        return {"pd_role": self.role, "pd_transfers_in_flight": self.in_flight(),
                "pd_transfers_completed": self.completed, "pd_transfers_failed": self.failed,
                "kv_transfer": {name: t.stats() for name, t in self.transports.items()}}

    def close_transports(self) -> None:
        for transport in self.transports.values():
            transport.close()
