"""Which PaddleFormers classes build a checkpoint, and whether the fallback can serve them.

An HF config's ``architectures[0]`` (``Phi3ForCausalLM``) names a family (``Phi3``) that
PaddleFormers lists in its auto-model table with its module (``phi3``); the fallback builds the
family's *base* model (``Phi3Model``: embedding, decoder layers, final norm) with PaddleFormers'
config class for the checkpoint's ``model_type``, and puts the core's LM head on top. The
base model is used because several PaddleFormers ``*ForCausalLM`` classes build through
``paddlefleet``, which is not on PyPI; the base models of the dense families do not need it.
"""

from __future__ import annotations

import importlib
import logging
import warnings
from dataclasses import dataclass

from fd_paddleformers.generations import GENERATIONS, Generation, generation_for

logger = logging.getLogger(__name__)

#: the name under which PaddleFormers' modeling modules look up their attention kernel
ATTENTION_TABLE = "ALL_ATTENTION_FUNCTIONS"
#: HF architecture suffixes the fallback serves (a causal LM head on the base model)
CAUSAL_LM_SUFFIX = "ForCausalLM"


class NotServableError(ValueError):
    """PaddleFormers cannot build this checkpoint, or the fallback cannot serve what it builds."""


@dataclass
class PaddleFormersTarget:
    """The PaddleFormers classes for one checkpoint."""

    family: str  # PaddleFormers' family key, e.g. "Phi3"
    generation: Generation  # the installed PaddleFormers generation's adapter
    module: str  # e.g. "paddleformers.transformers.phi3"
    config_cls: type
    base_model_cls: type


INSTALL_HINT = "pip install --no-deps paddleformers==0.4.0 (see plugins/fd-paddleformers/README.md)"


def import_paddleformers():
    """``(auto configuration, auto modeling, generation adapter)`` of the installed PaddleFormers.

    Raises :class:`NotServableError` with the install line if it cannot be imported.

    Importing PaddleFormers has process-wide effects: when torch is not imported yet it
    imports transformers with torch hidden (transformers then runs without torch in this
    process) and it sets ``sys.modules["torchcodec"] = None``.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import paddleformers
            import paddleformers.transformers
            from paddleformers.transformers.auto import configuration as auto_configuration
            from paddleformers.transformers.auto import modeling as auto_modeling
    except ImportError as exc:
        raise NotServableError(f"PaddleFormers is not importable ({exc}); {INSTALL_HINT}") from None
    version = str(getattr(paddleformers, "__version__", "unknown"))
    generation = generation_for(version)
    if generation is None:
        # an untested release: follow its major version's adapter, and say so
        generation = GENERATIONS[0] if version.startswith("0.") else GENERATIONS[1]
        checked = ", ".join(f"{g.name} ({'/'.join(g.versions)}x)" for g in GENERATIONS)
        logger.warning("PaddleFormers %s is installed; the fallback was checked on %s", version, checked)
    return auto_configuration, auto_modeling, generation


def resolve_target(hf_config: dict) -> PaddleFormersTarget:
    """PaddleFormers' config class and base model class for ``hf_config``.

    Raises :class:`NotServableError` saying why when PaddleFormers has no such family, the
    family's module does not import here (e.g. it needs ``paddlefleet``), or it is not a causal LM.
    """
    architectures = hf_config.get("architectures") or []
    if not architectures:
        raise NotServableError("config.json has no 'architectures' entry")
    architecture = architectures[0]
    if not architecture.endswith(CAUSAL_LM_SUFFIX):
        raise NotServableError(f"{architecture} is not a causal language model (*{CAUSAL_LM_SUFFIX})")
    family = architecture[: -len(CAUSAL_LM_SUFFIX)]
    auto_configuration, auto_modeling, generation = import_paddleformers()
    module_name = auto_modeling.MAPPING_NAMES.get(family)
    if module_name is None:
        known = ", ".join(f"{k}{CAUSAL_LM_SUFFIX}" for k in auto_modeling.MAPPING_NAMES)
        raise NotServableError(f"{generation.name} has no implementation of {architecture} (it knows: {known})")
    module_path = f"paddleformers.transformers.{module_name}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = importlib.import_module(module_path)
    except Exception as exc:  # e.g. ImportError: paddlefleet is required for gpt_provider
        raise NotServableError(f"PaddleFormers' {module_path} does not import here: {exc}") from None
    base_name = generation.base_model_name(auto_modeling, family)
    try:
        base_model_cls = getattr(module, base_name)
    except Exception as exc:  # PaddleFormers' lazy modules raise their own error types
        raise NotServableError(f"PaddleFormers cannot provide {base_name}: {exc}") from None
    model_type = hf_config.get("model_type")
    config_cls = None
    if model_type:
        try:
            config_cls = auto_configuration.CONFIG_MAPPING[model_type]
        except Exception:
            config_cls = None
    if config_cls is None:
        config_cls = getattr(base_model_cls, "config_class", None)
    if config_cls is None:
        raise NotServableError(f"PaddleFormers has no config class for model_type {model_type!r}")
    return PaddleFormersTarget(family, generation, module_path, config_cls, base_model_cls)
