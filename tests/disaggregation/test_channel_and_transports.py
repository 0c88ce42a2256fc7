"""The prefill/decode channel's sealing and the cpu device's KV transports, without processes."""

from __future__ import annotations

import os
import re
import time
from types import SimpleNamespace

import numpy as np
import pytest

from fastdeploy_core.builtin.cpu.device import CpuDevice
from fastdeploy_core.sealing import MAX_SKEW_S
from fastdeploy_core.builtin.cpu.kv_transport import SHM_DIR, ShmKVTransport, TcpKVTransport
from fastdeploy_core.devices.kv_transport import block_nbytes, cache_signature, host_views
from fastdeploy_core.disaggregation import channel as channel_mod
from fastdeploy_core.disaggregation.channel import TO_DECODE, TO_PREFILL, Channel, channel_key
from fastdeploy_core.disaggregation.decode import DecodeConnector
from fastdeploy_core.errors import ConfigError, KVTransferError


def _caches(num_blocks: int, seed: int) -> list[tuple]:
    rng = np.random.default_rng(seed)
    return [tuple(CpuDevice.zeros((num_blocks, 4, 2, 8), "float32") for _ in range(2)) for _ in range(3)], rng


def _fill(caches, rng) -> None:
    for layer in host_views(caches):
        for v in layer:
            v[...] = rng.standard_normal(v.shape, dtype=np.float32)


@pytest.mark.parametrize("transport_cls", [TcpKVTransport, ShmKVTransport])
def test_blocks_arrive_in_the_receivers_blocks_and_nowhere_else(transport_cls):
    src, rng = _caches(10, 0)
    dst, _ = _caches(12, 1)
    _fill(src, rng)
    src_views, dst_views = host_views(src), host_views(dst)
    assert cache_signature(src_views) == cache_signature(dst_views)
    before = [[v.copy() for v in layer] for layer in dst_views]
    sender, receiver = transport_cls(), transport_cls()
    local, remote = [7, 2, 5], [0, 11, 3]
    buffer, handle = sender.buffer(len(local) * block_nbytes(src_views), "t1")
    sender.gather(src_views, local, buffer)
    description, frames = sender.send(buffer, handle)
    del buffer
    wire = [bytes(memoryview(f).cast("B")) for f in frames]  # what a socket would deliver
    data = receiver.receive(description, wire)
    receiver.scatter(dst_views, remote, data)
    del data
    receiver.release(description)
    for layer_src, layer_dst, layer_before in zip(src_views, dst_views, before):
        for s, d, b in zip(layer_src, layer_dst, layer_before):
            np.testing.assert_array_equal(d[remote], s[local])
            untouched = [i for i in range(12) if i not in remote]
            np.testing.assert_array_equal(d[untouched], b[untouched])
    # The tensors the model reads see the new blocks (the views share their memory).
    np.testing.assert_array_equal(dst[0][0].numpy()[11], src_views[0][0][2])
    assert sender.bytes_sent == receiver.bytes_received == 3 * block_nbytes(src_views)
    if transport_cls is ShmKVTransport:
        assert frames == [] and not os.path.exists(os.path.join(SHM_DIR, description["segment"]))
    else:
        assert len(frames) == 1


@pytest.mark.parametrize("transport_cls", [TcpKVTransport, ShmKVTransport])
def test_bf16_blocks_travel_as_their_bytes(transport_cls):
    """A bfloat16 cache (--kv-cache-dtype bfloat16) is moved byte for byte; its signature differs
    from a float32 cache's, so the two never pair."""
    import paddle

    def caches(num_blocks):
        return [tuple(CpuDevice.zeros((num_blocks, 4, 2, 8), "bfloat16") for _ in range(2)) for _ in range(2)]

    src, dst = caches(6), caches(5)
    rng = np.random.default_rng(4)
    for layer in src:
        for t in layer:
            t.copy_(paddle.to_tensor(rng.standard_normal(t.shape).astype(np.float32)).astype("bfloat16"), False)
    src_views, dst_views = host_views(src), host_views(dst)
    assert cache_signature(src_views) == cache_signature(dst_views) != cache_signature(host_views(_caches(5, 0)[0]))
    assert block_nbytes(src_views) == 2 * 2 * (4 * 2 * 8 * 2)
    sender, receiver = transport_cls(), transport_cls()
    local, remote = [4, 1], [2, 0]
    buffer, handle = sender.buffer(len(local) * block_nbytes(src_views), "b1")
    sender.gather(src_views, local, buffer)
    description, frames = sender.send(buffer, handle)
    del buffer
    data = receiver.receive(description, [bytes(memoryview(f).cast("B")) for f in frames])
    receiver.scatter(dst_views, remote, data)
    del data
    receiver.release(description)
    for layer_src, layer_dst in zip(src, dst):
        for s, d in zip(layer_src, layer_dst):  # the tensors the model reads, as bfloat16
            assert d.dtype == paddle.bfloat16
            np.testing.assert_array_equal(d.numpy()[remote], s.numpy()[local])
            assert not d.numpy()[[1, 3, 4]].any()


def test_an_untaken_shm_segment_is_removed_by_its_sender():
    sender = ShmKVTransport()
    buffer, handle = sender.buffer(64, "t")
    description, _ = sender.send(buffer, handle)
    del buffer
    path = os.path.join(SHM_DIR, description["segment"])
    assert os.path.exists(path) and (os.stat(path).st_mode & 0o777) == 0o600
    sender.close()
    assert not os.path.exists(path)


def test_shm_refuses_a_segment_name_outside_its_own():
    with pytest.raises(ValueError, match="names one segment"):
        ShmKVTransport().receive({"segment": "../etc/passwd", "nbytes": 4}, [])


def test_the_cpu_device_offers_shm_and_tcp_and_refuses_others():
    assert set(CpuDevice.kv_transports) == {"shm", "tcp"}
    assert isinstance(CpuDevice.make_kv_transport("tcp"), TcpKVTransport)
    with pytest.raises(ConfigError, match="'rdma' is not a KV transport of device 'cpu'"):
        CpuDevice.make_kv_transport("rdma")


def test_the_channel_opens_only_what_the_other_side_sealed(monkeypatch):
    key = channel_key("secret")
    decode, prefill = Channel(key, TO_PREFILL, TO_DECODE), Channel(key, TO_DECODE, TO_PREFILL)
    payload = np.arange(16, dtype=np.uint8)
    frames = prefill.seal({"type": "kv", "tid": "a", "seq": 0}, [payload])
    wire = [bytes(memoryview(f).cast("B")) if not isinstance(f, bytes) else f for f in frames]
    header, got = decode.open(wire, "p")
    assert header == {"type": "kv", "tid": "a", "seq": 0} and bytes(got[0]) == payload.tobytes()
    assert prefill.open(wire, "p") is None  # reflected back to its sender
    tampered = list(wire)
    tampered[4] = b"\x01" + wire[4][1:]
    assert decode.open(tampered, "p") is None
    other = Channel(channel_key("another secret"), TO_DECODE, TO_PREFILL)
    assert decode.open(other.seal({"type": "kv"}), "p") is None
    past = time.time() - 2 * MAX_SKEW_S
    monkeypatch.setattr(channel_mod.time, "time", lambda: past)
    stale = prefill.seal({"type": "kv"})
    monkeypatch.undo()
    assert decode.open(stale, "p") is None
    assert decode.rejected == 3 and prefill.rejected == 1


def test_a_prompt_the_decode_cache_cannot_hold_is_a_clear_error_with_nothing_held():
    import zmq

    caches, _ = _caches(4, 0)
    engine = SimpleNamespace(
        runner=SimpleNamespace(device_cls=CpuDevice, kv_caches=caches),
        block_manager=SimpleNamespace(block_size=4, num_free_blocks=3, num_blocks=4, blocks_needed=lambda n: -(-n // 4)),
        reserve_remote=lambda request: None,
    )
    connector = DecodeConnector(engine, channel_key("s"), ["tcp"], zmq)
    params = SimpleNamespace(n=1, prompt_logprobs=None, guided_decoding=None)
    request = SimpleNamespace(request_id="r", prompt_token_ids=list(range(30)), sampling_params=params,
                              disaggregate={"prefill": "127.0.0.1:1", "protocols": ["tcp"]})
    with pytest.raises(KVTransferError, match="the prompt needs 8 KV blocks and this decode instance has 3 free of 4"):
        connector.start(request)
    assert connector.transfers == {} and connector.peers == {}
    mismatch = SimpleNamespace(**{**vars(request), "disaggregate": {"prefill": "127.0.0.1:1", "protocols": ["shm"]}})
    with pytest.raises(KVTransferError, match="give both a common --cache-transfer-protocol"):
        connector.start(mismatch)
    connector.close()


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        ({"splitwise_role": "prefill", "router": "h:1"}, "splitwise_role prefill needs --pd-comm-port"),
        ({"splitwise_role": "decode", "router": "h:1", "pd_comm_port": 9100}, "only prefill instances bind it"),
        ({"splitwise_role": "decode"}, "needs --router HOST:PORT"),
        ({"cache_transfer_protocol": "shm"}, "a mixed instance moves no KV cache"),
        ({"splitwise_role": "decode", "router": "h:1", "cache_transfer_protocol": "tcp,,shm"}, "distinct transport"),
        ({"splitwise_role": "decode", "router": "h:1", "scheduler_name": "global"}, "use --scheduler-name local"),
        ({"splitwise_role": "decode", "router": "h:1", "tensor_parallel_size": 2}, "use --tensor-parallel-size 1"),
    ],
)
def test_role_settings_that_cannot_work_are_refused_naming_the_fix(flags, says):
    from fastdeploy_core.config import EngineArgs

    with pytest.raises(ConfigError, match=re.escape(says)):
        EngineArgs.create(**flags)
    assert EngineArgs.create(splitwise_role="prefill", router="h:1", pd_comm_port=9100,
                             cache_transfer_protocol="shm, tcp").splitwise.protocols == ["shm", "tcp"]


def test_a_quantized_kv_cache_is_refused_for_transfer():
    from fastdeploy_core.quantization.kv_cache import QuantizedKVCache

    cache = QuantizedKVCache(4, 4, 2, 8, CpuDevice.zeros)
    with pytest.raises(ConfigError, match="move float KV caches only"):
        host_views([(cache, cache)])
