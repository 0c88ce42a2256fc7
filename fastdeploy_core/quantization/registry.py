"""Resolve ``--quantization NAME | JSON`` (or a checkpoint's ``quantization_config``) to a quantizer.

:func:`resolve_quantization` is the one entry point the engine uses:

* ``"wint8"`` or ``'{"quantization": "wint4", "group_size": 64}'`` or a dict; ``mix_quant``
  JSON with ``dense_quant_type`` / ``moe_quant_type`` / ``kv_cache_quant_type``; a JSON with
  only ``kv_cache_quant_type`` quantizes just the KV cache;
* a checkpoint whose ``config.json`` carries ``quantization_config`` is honoured: its method is
  used with ``is_quantized=True`` (FastDeploy's ``{"quantization": ...}`` form, or the HF form
  ``{"quant_method": "fp8", "weight_block_size": [128, 128]}`` -> ``block_wise_fp8``);
* every method is looked up in the plugin manager's quantizer registry: an unknown name lists
  the registered ones; a device whose ``quantization_methods`` lacks the method raises an
  error naming the devices that run it.

Every problem is a :class:`~fastdeploy_core.errors.QuantizationError`.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from fastdeploy_core.errors import QuantizationError
from fastdeploy_core.quantization.factory import _registry, build_quantizer

if TYPE_CHECKING:
    from fastdeploy_core.quantization.base import QuantizerBase

#: HF ``quant_method`` names -> our registry names (when they differ).
HF_METHOD_NAMES = {"fp8": "block_wise_fp8"}


def parse_spec(spec: str | dict | None) -> dict | None:
    """``--quantization`` text (a name or JSON) or a dict -> a dict with a ``quantization`` key, or None."""
    if spec is None:
        return None
    if isinstance(spec, dict):
        return dict(spec)
    text = str(spec).strip()
    if not text:
        return None
    if text[0] in "{[":
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise QuantizationError(
                f"--quantization: {text!r} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
                'pass a method name such as "wint8" or a JSON object such as '
                '{"quantization": "mix_quant", "dense_quant_type": "wint8", "kv_cache_quant_type": "int8"}',
                param="quantization",
            ) from None
        if not isinstance(value, dict):
            raise QuantizationError(
                f"--quantization JSON must be an object, got {type(value).__name__}", param="quantization"
            )
        return value
    return {"quantization": text}


def checkpoint_spec(hf_config: dict | None) -> dict | None:
    """The method a checkpoint's ``quantization_config`` asks for (``is_quantized`` set), or None."""
    qc = (hf_config or {}).get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise QuantizationError(f"the checkpoint's quantization_config is not an object: {qc!r}")
    data = dict(qc)
    name = data.pop("quantization", None) or data.pop("quant_method", None)
    if not name:
        raise QuantizationError(
            f"the checkpoint's quantization_config names no method (no 'quantization' or 'quant_method'): {qc}"
        )
    name = HF_METHOD_NAMES.get(name, name)
    data.setdefault("is_quantized", True)
    return {"quantization": name, **data, "_from_checkpoint": True}


def check_device(quantizer: QuantizerBase, device, plugin_manager) -> None:
    """Raise when ``device`` (a Device class) does not declare every method ``quantizer`` needs."""
    pm = _registry(plugin_manager)
    for method in quantizer.required_methods():
        cls = pm.quantizers.get(method)
        if isinstance(cls, str):
            from fastdeploy_core.plugins import import_target

            cls = import_target(cls)
        if cls is not None and not getattr(cls, "requires_device_support", True):
            continue
        if method in getattr(device, "quantization_methods", ()):
            continue
        able = sorted(
            name
            for name in pm.devices.keys()  # noqa: SIM118 - a Registry, not a dict
            if method in getattr(pm.devices.get(name), "quantization_methods", ())
        )
        where = f"devices that run it: {', '.join(able)}" if able else "no installed device runs it"
        raise QuantizationError(
            f"quantization method {method!r} is not supported on device {device.name!r} "
            f"(it runs: {', '.join(device.quantization_methods) or 'no quantization methods'}); {where}",
            param="quantization",
        )


def resolve_quantization(
    spec: str | dict | None = None,
    *,
    device=None,
    plugin_manager=None,
    hf_config: dict | None = None,
    gguf_path: str | None = None,
) -> QuantizerBase | None:
    """The quantizer for ``--quantization spec`` and the checkpoint's own config, checked against ``device``.

    ``gguf_path``: the model is this GGUF file; a method that can hold its linear weights' blocks
    as stored (``wint8`` for Q8_0, ``wint4`` for Q4_0/Q4_1) switches to groups of 32 unless the
    user set ``group_size``. Returns ``None`` when nothing is quantized.
    """
    pm = _registry(plugin_manager)
    user = parse_spec(spec)
    ckpt = checkpoint_spec(hf_config)
    if user is not None and ckpt is not None:
        user_name = user.get("quantization")
        if user_name not in (None, ckpt["quantization"]):
            raise QuantizationError(
                f"the checkpoint is already quantized with {ckpt['quantization']!r}; --quantization {user_name!r} "
                f"cannot requantize it: drop --quantization or pass {ckpt['quantization']!r}",
                param="quantization",
            )
        data = {**ckpt, **{k: v for k, v in user.items() if k != "quantization"}}
    else:
        data = user if user is not None else ckpt
    if data is None:
        return None
    data = dict(data)
    lenient = bool(data.pop("_from_checkpoint", False))
    name = data.pop("quantization", None)
    if name is None:
        if data.get("kv_cache_quant_type"):
            name = "mix_quant"  # only the KV cache is quantized
        else:
            raise QuantizationError(
                f'--quantization JSON names no method: add "quantization": "<method>" (given {sorted(data)})',
                param="quantization",
            )
    if not isinstance(name, str):
        raise QuantizationError(f"'quantization' must be a method name, got {name!r}", param="quantization")
    quantizer = build_quantizer(name, data, pm, lenient=lenient)
    if gguf_path is not None:
        from fastdeploy_core.loader.gguf_loader import linear_tensor_types

        quantizer = quantizer.for_gguf(linear_tensor_types(gguf_path))
    if device is not None:
        check_device(quantizer, device, pm)
    return quantizer


def describe_methods(plugin_manager=None) -> dict[str, Any]:
    """Every registered method with the plugin that registered it and its settings."""
    pm = _registry(plugin_manager)
    out = {}
    for name in sorted(pm.quantizers.keys()):
        entry = pm.quantizers.entry(name)
        cls = entry.value
        if isinstance(cls, str):
            from fastdeploy_core.plugins import import_target

            cls = import_target(cls)
        out[name] = {"plugin": entry.plugin, "settings": sorted(cls.config_class.model_fields)}
    return out
