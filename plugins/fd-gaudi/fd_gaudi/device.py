"""Intel Gaudi HPUs as Paddle exposes them: the custom device ``intel_hpu`` (PaddleCustomDevice runtime)."""

from __future__ import annotations

from fastdeploy_core.devices.custom import PaddleCustomDevice

from fd_gaudi.ops import GaudiOps


class IntelHpu(PaddleCustomDevice):
    """``--device intel_hpu``: Paddle with the ``intel_hpu`` custom-device runtime loaded and a chip visible.

    Detection asks ``paddle.device.get_all_custom_device_type()`` and
    ``paddle.device.custom_device.device_count("intel_hpu")``; collectives go through Paddle's
    ``xccl`` with ``PADDLE_XCCL_BACKEND=intel_hpu`` (see :attr:`dist_env`).
    """

    name = "intel_hpu"
    paddle_device_type = "intel_hpu"
    priority = 80
    supported_dtypes = ("bfloat16", "float32")
    supports_graph_capture = False
    # FastDeploy docs/get_started/installation/intel_gaudi.md names tensor_wise_fp8 (models converted to FP8
    # offline); no method here reads that format, so none is declared and a quantized run is refused.
    quantization_methods = ()
    attention_backends = GaudiOps.attention_backends
    package = "fd-gaudi"
    runtime_package = "paddle_intel_hpu"  # built from PaddleCustomDevice/backends/intel_hpu
    visible_devices_env = "INTEL_HPU_VISIBLE_DEVICES"
    ops_class = GaudiOps
