"""Which Paddle kernels exist for a tensor's place and dtype, asked of Paddle's kernel registry.

An ops class that wants a fused kernel asks :func:`has_kernel` with the tensor it is about to
pass; the answer comes from the phi kernel registry of the running Paddle build
(``paddle.base.core._get_registered_phi_kernels``), keyed by the *place the tensor lives on*
and its dtype. No device names are involved: the same ops class falls back to the reference
op on a CPU build and takes the fused kernel on a build/place that registers it.

Registry keys look like ``"(CPU, Undefined(AnyLayout), float32)"``; CUDA and ROCm builds
register under ``GPU`` (and ``GPUDNN``), Kunlunxin under ``XPU``, custom devices under their
device type (``iluvatar_gpu``, ``metax_gpu``, ``gcu``, ``intel_hpu``...).
"""

from __future__ import annotations

import re
from functools import lru_cache

import paddle

from fastdeploy_core.devices.host_cpu import PADDLE_AVX512_ONLY_CPU_KERNELS, paddle_cpu_kernel_safe

_KEY = re.compile(r"^\(\s*([^,]+?)\s*,\s*[^,]+?\s*,\s*([a-z0-9_]+)\s*\)$")

#: Registry backends that serve a place, in the order kernels are looked up.
_GPU_BACKENDS = ("gpu", "gpudnn")


@lru_cache(maxsize=1)
def registered_kernels() -> dict[str, frozenset[tuple[str, str]]]:
    """Kernel name -> {(backend, dtype)} for every phi kernel this Paddle build registers."""
    from paddle.base import core

    table: dict[str, set[tuple[str, str]]] = {}
    for name, keys in core._get_registered_phi_kernels("function").items():
        entries = table.setdefault(name, set())
        for key in keys:
            match = _KEY.match(key)
            if match:
                entries.add((match.group(1).strip().lower(), match.group(2)))
    return {name: frozenset(v) for name, v in table.items()}


def place_backends(place) -> tuple[str, ...]:
    """The registry backend names that serve ``place`` (a ``paddle.Place`` or a tensor's ``.place``)."""
    if place.is_cpu_place():
        return ("cpu",)
    if place.is_gpu_place():
        return _GPU_BACKENDS
    if place.is_xpu_place():
        return ("xpu",)
    if place.is_custom_place():
        return (place.get_device_type().lower(),)
    return ()


def dtype_name(dtype) -> str:
    """``paddle.float32`` / ``"float32"`` / ``DataType.FLOAT32`` -> ``"float32"``."""
    text = str(dtype).lower()
    return text.rsplit(".", 1)[-1]


def has_kernel(kernel: str, tensor: paddle.Tensor) -> bool:
    """Whether Paddle registers ``kernel`` for ``tensor``'s place and dtype, and it can run there
    (a CPU kernel Paddle built for AVX-512 only does not on a CPU without it: ``host_cpu``)."""
    if kernel in PADDLE_AVX512_ONLY_CPU_KERNELS and not paddle_cpu_kernel_safe(tensor):
        return False
    return _has_kernel(kernel, place_backends(tensor.place), dtype_name(tensor.dtype))


@lru_cache(maxsize=512)
def _has_kernel(kernel: str, backends: tuple[str, ...], dtype: str) -> bool:
    entries = registered_kernels().get(kernel)
    if not entries:
        return False
    return any((backend, dtype) in entries for backend in backends)


def kernel_places(kernel: str) -> list[str]:
    """``["cpu/float32", "gpu/bfloat16", ...]``: where ``kernel`` exists in this build (for reports)."""
    return sorted(f"{backend}/{dtype}" for backend, dtype in registered_kernels().get(kernel, ()))
