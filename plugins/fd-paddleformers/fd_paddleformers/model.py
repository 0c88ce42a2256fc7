"""The PaddleFormers fallback model: a decoder PaddleFormers builds, served by our engine.

:class:`PaddleFormersForCausalLM` has the model interface of the native models
(``forward(meta, kv_caches) -> hidden [T, H]``, ``compute_logits``, ``load_weights``,
``kv_cache_spec``), so the engine runs it unchanged. Inside:

* PaddleFormers builds the family's base model from the checkpoint's config, on the default
  float32 dtype, with the fused kernels the device may lack switched off
  (``fuse_rms_norm=False``: ``fused_rms_norm_ext`` has no CPU kernel);
* its attention kernel is the core paged attention, reached through PaddleFormers'
  attention-function table (:mod:`fd_paddleformers.attention`);
* its ``nn.Linear`` layers become core :class:`~fastdeploy_core.layers.linear.Linear` (so
  quantization methods apply), its RMS norms the core ``RMSNorm`` and its token embedding the
  core ``VocabEmbedding`` (device ops); the LM head is the core ``LMHead``;
* its mixture-of-experts blocks become the core ``SparseMoeBlock``, or the grouped router and
  ``FusedMoE`` (DeepSeek-V3) (:mod:`fd_paddleformers.moe`);
* DeepSeek-V3's latent attention caches its expanded per-head K/V (:mod:`fd_paddleformers.mla`);
* weights load from the HF checkpoint names, through the installed generation's mapping
  (:mod:`fd_paddleformers.generations`: equal names on 0.4, PaddleFormers' own declaration on 1.x).

The whole step is one ragged batch ``[1, T]``: RoPE follows ``meta.positions`` and attention
follows the block tables, so no per-request work happens in Python.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Iterable

import numpy as np
import paddle
from paddle import nn

from fastdeploy_core.errors import ModelLoadError, UnsupportedArchitectureError
from fastdeploy_core.executor.forward_meta import ForwardMeta
from fastdeploy_core.layers.attention import Attention
from fastdeploy_core.layers.embedding import LMHead, VocabEmbedding
from fastdeploy_core.layers.linear import Linear, LinearMethodBase, MergedColumnLinear
from fastdeploy_core.layers.norm import RMSNorm
from fd_paddleformers.architectures import ATTENTION_TABLE, NotServableError, PaddleFormersTarget, resolve_target
from fd_paddleformers.attention import (
    ATTENTION_IMPLEMENTATION,
    BINDING_ATTRIBUTE,
    PagedAttentionBinding,
    StepContext,
    register_paged_attention,
)
from fd_paddleformers import mla
from fd_paddleformers.generations import MappingNotDeclared
from fd_paddleformers.parallel_plan import local_heads, parallel_plan
from fd_paddleformers.moe import checkpoint_sources, is_moe_block, make_block, router_spec
from fd_paddleformers.rotary import fallback_step, install_fast_rotary
from fd_paddleformers.weight_mapping import Rule, fuse

logger = logging.getLogger(__name__)

#: checkpoint keys that only drive HF behaviour and would confuse the PaddleFormers config
DROPPED_CONFIG_KEYS = ("torch_dtype", "dtype", "transformers_version", "quantization_config", "auto_map")
#: where HF causal-LM checkpoints keep the base model's tensors
HF_BASE_PREFIX = "model"
#: checkpoint tensors no implementation needs
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _sliding_window_problem(hf_config: dict) -> str | None:
    window = hf_config.get("sliding_window")
    if window is None or hf_config.get("use_sliding_window") is False:
        return None
    max_positions = int(hf_config.get("max_position_embeddings") or 0)
    if max_positions and int(window) >= max_positions:
        return None  # the window never cuts anything off
    return (
        f"sliding-window attention (sliding_window={window} < max_position_embeddings={max_positions}) "
        "is not implemented by the paged attention yet"
    )


def make_paddleformers_config(target: PaddleFormersTarget, hf_config: dict):
    """PaddleFormers' config for the checkpoint, read as its generation reads it, with the overrides."""
    overrides = target.generation.config_overrides()
    values = {k: v for k, v in target.generation.prepare_config(hf_config).items() if k not in DROPPED_CONFIG_KEYS}
    values.update(overrides)
    values["_attn_implementation"] = ATTENTION_IMPLEMENTATION
    act = str(values.get("hidden_act", "silu"))
    # PaddleFormers' MLP applies swiglu (silu(gate) * up) as one op only when told to
    values["fuse_swiglu"] = act in ("silu", "swish")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = target.config_cls(**values)
    for key, value in overrides.items():
        setattr(config, key, value)
    config._attn_implementation = ATTENTION_IMPLEMENTATION
    return config


def mapping_rules(target: PaddleFormersTarget, config) -> list[Rule]:
    """The checkpoint -> parameter rules the installed generation declares for the base model."""
    try:
        return target.generation.mapping_rules(target.base_model_cls, config)
    except MappingNotDeclared as exc:
        raise NotServableError(str(exc)) from None


def check_servable(hf_config: dict) -> tuple[PaddleFormersTarget, object, list[Rule]]:
    """Resolve and validate without building the model; raises :class:`NotServableError`."""
    target = resolve_target(hf_config)
    problem = _sliding_window_problem(hf_config)
    if problem:
        raise NotServableError(problem)
    problem = mla.config_problem(target.family, hf_config)
    if problem:
        raise NotServableError(problem)
    config = make_paddleformers_config(target, hf_config)
    rules = mapping_rules(target, config)
    return target, config, rules


def _paddleformers_rms_norm_class():
    from paddleformers.nn.norm import RMSNorm as PaddleFormersRMSNorm

    return PaddleFormersRMSNorm


class PaddleFormersForCausalLM(nn.Layer):
    """A PaddleFormers base model adapted to the engine's model interface (see the module doc).

    Args:
        hf_config: the checkpoint's ``config.json`` as a dict.
        quant_config: the engine's quantization config (``get_quant_method(layer, prefix)``),
            applied to every linear layer; ``None`` keeps float32 weights.
    """

    def __init__(self, hf_config: dict, quant_config=None):
        super().__init__()
        architecture = (hf_config.get("architectures") or ["<no architectures>"])[0]
        try:
            target, pf_config, rules = check_servable(hf_config)
        except NotServableError as exc:
            raise UnsupportedArchitectureError(
                f"the PaddleFormers fallback cannot serve {architecture}: {exc}"
            ) from None
        register_paged_attention()
        target.generation.prepare_modules()
        self.config = hf_config
        self.pf_config = pf_config
        self.target = target
        self.quant_config = quant_config
        previous_dtype = paddle.get_default_dtype()
        paddle.set_default_dtype("float32")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.model = target.base_model_cls(pf_config)
        finally:
            paddle.set_default_dtype(previous_dtype)
        self.model.eval()
        for name, param in self.model.named_parameters():
            if param.dtype != paddle.float32:
                raise UnsupportedArchitectureError(f"PaddleFormers built {name} as {param.dtype}, not float32")

        self.num_layers = int(pf_config.num_hidden_layers)
        self.num_heads = int(pf_config.num_attention_heads)
        self.num_kv_heads = int(getattr(pf_config, "num_key_value_heads", None) or self.num_heads)
        self.hidden_size = int(pf_config.hidden_size)
        self.head_dim = int(getattr(pf_config, "head_dim", None) or self.hidden_size // self.num_heads)
        self.vocab_size = int(pf_config.vocab_size)
        self.tie_word_embeddings = bool(getattr(pf_config, "tie_word_embeddings", False))

        # multi-token-prediction layers (DeepSeek-V3 stores them as decoder layers after the last
        # one) serve speculative decoding only: the fallback builds none (num_nextn_predict_layers=0)
        nextn = int(hf_config.get("num_nextn_predict_layers") or 0)
        self._skipped_prefixes = tuple(
            f"{HF_BASE_PREFIX}.layers.{i}." for i in range(self.num_layers, self.num_layers + nextn)
        )
        self._step = StepContext()
        mla.drop_unused_norm(self.model)
        self._linear_weights: set[str] = set()
        #: parameter named by PaddleFormers' mapping -> (merged parameter, shard)
        self._redirects: dict[str, tuple[str, str]] = {}
        #: checkpoint projection -> (merged layer, shard), for loaders that route by layer name
        self.packed_modules_mapping: dict[str, tuple[str, str]] = {}
        self.rules = self._complete_rules(rules)
        self._swap_moe(architecture)
        #: linears that split across tensor-parallel ranks (empty with one rank)
        self.tp_plan = parallel_plan(self.model, self.num_heads, self.num_kv_heads, self.head_dim)
        self.num_local_heads, self.num_local_kv_heads = local_heads(self.num_heads, self.num_kv_heads, self.tp_plan)
        self._merge_gate_up()
        self._swap_layers()
        self._bind_attention(architecture)
        self.lm_head = LMHead(self.vocab_size, self.hidden_size, quant_config=quant_config)
        for rule in self.rules:
            if rule.dest in self._redirects:
                rule.dest, rule.shard = self._redirects[rule.dest]
        self._check_rules(architecture)

    # ---- building --------------------------------------------------------------------------
    def _replacement(self, child: nn.Layer, path: str, pf_rms_norm: type) -> nn.Layer | None:
        if type(child) is nn.Linear:
            in_features, out_features = child.weight.shape
            tp, share = self.tp_plan.get(path, (None, None))
            layer = Linear(
                in_features,
                out_features,
                bias=child.bias is not None,
                quant_config=self.quant_config,
                prefix=f"model.{path}",
                tp=tp,
                tp_range=share,
            )
            self._linear_weights.add(f"{path}.weight")
            return layer
        if type(child) is pf_rms_norm:
            return RMSNorm(int(child.weight.shape[0]), float(child.variance_epsilon))
        if path == "embed_tokens" and type(child) is nn.Embedding:
            num, dim = child.weight.shape
            return VocabEmbedding(int(num), int(dim), quant_config=self.quant_config, prefix="model.embed_tokens")
        return None

    def _merge_gate_up(self) -> None:
        """Run PaddleFormers' MLPs in their own fused mode: one ``[gate | up]`` matmul + swiglu.

        PaddleFormers' generic ``MLP`` has a fused mode (``fuse_up_gate``: one projection whose
        output it feeds to ``swiglu``) that some families build and others (Llama) do not. For a
        SiLU-gated MLP built unfused, the two projections are replaced by one core
        ``MergedColumnLinear`` and the MLP is switched to that mode; the checkpoint's gate and up
        tensors load into its two shards.
        """
        from paddleformers.nn.mlp import MLP as PaddleFormersMLP

        for path, mlp in list(self.model.named_sublayers()):
            if not isinstance(mlp, PaddleFormersMLP) or type(mlp).forward is not PaddleFormersMLP.forward:
                continue
            if mlp.fuse_up_gate or mlp.act_type not in ("silu", "swish"):
                continue
            gate, up = mlp.gate_proj, mlp.up_proj
            if type(gate) is not nn.Linear or type(up) is not nn.Linear or gate.weight.shape != up.weight.shape:
                continue
            hidden, inter = (int(n) for n in gate.weight.shape)
            # 1.x names the fused projection per family (gate_up_proj_name); 0.4 always calls it up_gate_proj
            fused_name = getattr(mlp, "gate_up_proj_name", "up_gate_proj")
            names = {}
            for name, child in list(mlp._sub_layers.items()):
                if child is gate or child is up:
                    names.setdefault("gate" if child is gate else "up", name)
                    del mlp._sub_layers[name]
            down_plan = self.tp_plan.get(f"{path}.down_proj")
            merged = MergedColumnLinear(
                hidden,
                [inter, inter],
                bias=gate.bias is not None,
                quant_config=self.quant_config,
                prefix=f"model.{path}.{fused_name}",
                shard_names=("gate", "up"),
                tp="column" if down_plan else None,
                tp_shares=(down_plan[1], down_plan[1]) if down_plan else None,
            )
            setattr(mlp, fused_name, merged)
            mlp.fuse_up_gate = True
            mlp.fuse_swiglu = True
            self._linear_weights.add(f"{path}.{fused_name}.weight")
            for shard, name in names.items():
                for tensor in ("weight", "bias"):
                    self._redirects[f"{path}.{name}.{tensor}"] = (f"{path}.{fused_name}.{tensor}", shard)
                self.packed_modules_mapping[name] = (fused_name, shard)

    def _swap_layers(self) -> None:
        """Replace PaddleFormers' linears, RMS norms and embedding by the core layers, in place."""
        pf_rms_norm = _paddleformers_rms_norm_class()
        parents = [("", self.model)] + [(name, layer) for name, layer in self.model.named_sublayers()]
        for parent_path, parent in parents:
            for name, child in list(parent._sub_layers.items()):
                if child is None:
                    continue
                path = f"{parent_path}.{name}" if parent_path else name
                new = self._replacement(child, path, pf_rms_norm)
                if new is not None:
                    setattr(parent, name, new)
        leftovers = [n for n, layer in self.model.named_sublayers() if type(layer) is nn.Linear]
        if leftovers:
            raise UnsupportedArchitectureError(f"linear layers left unswapped: {leftovers[:5]}")
        if not isinstance(getattr(self.model, "embed_tokens", None), VocabEmbedding):
            raise UnsupportedArchitectureError(
                f"{type(self.model).__name__} has no plain token embedding 'embed_tokens' the fallback can drive"
            )

    def _bind_attention(self, architecture: str) -> None:
        layers = getattr(self.model, "layers", None)
        if layers is None or len(layers) != self.num_layers:
            raise UnsupportedArchitectureError(
                f"the PaddleFormers fallback cannot serve {architecture}: its base model has no "
                f"'layers' list of {self.num_layers} decoder layers"
            )
        modules = {type(getattr(layer, "self_attn", None)).__module__ for layer in layers}
        for name in modules:
            if ATTENTION_TABLE not in vars(sys.modules.get(name) or object):
                raise UnsupportedArchitectureError(
                    f"the PaddleFormers fallback cannot serve {architecture}: {self.target.generation.name}'s "
                    f"attention ({name}) computes attention itself instead of through the attention-function "
                    f"table ({ATTENTION_TABLE}), so it cannot use the engine's paged KV cache"
                )
        self.fast_rotary = all(install_fast_rotary(name) for name in modules)
        #: MLA modules, whose reshape follows the step's token count (:func:`mla.set_step_length`)
        self._latent_attention: list[nn.Layer] = []
        for index, layer in enumerate(layers):
            attn = getattr(layer, "self_attn", None)
            if attn is None:
                raise UnsupportedArchitectureError(
                    f"the PaddleFormers fallback cannot serve {architecture}: decoder layer {index} has no self_attn"
                )
            if mla.is_latent_attention(attn):
                if not mla.install_rotary(type(attn).__module__):
                    raise UnsupportedArchitectureError(
                        f"the PaddleFormers fallback cannot serve {architecture}: {type(attn).__module__}'s "
                        "apply_rotary_pos_emb is not the interleaved form the fallback checked"
                    )
                self.num_kv_heads, self.head_dim = mla.cache_dims(attn)
                core_attention = Attention(self.num_heads, self.head_dim, self.num_kv_heads, mla.kernel_scale(attn))
                mla.bind(attn, PagedAttentionBinding(index, core_attention, self._step, self.target.generation))
                self._latent_attention.append(attn)
                continue
            scale = getattr(attn, "scaling", None)
            core_attention = Attention(self.num_local_heads, self.head_dim, self.num_local_kv_heads, scale)
            setattr(
                attn,
                BINDING_ATTRIBUTE,
                PagedAttentionBinding(index, core_attention, self._step, self.target.generation),
            )

    def _complete_rules(self, rules: list[Rule]) -> list[Rule]:
        """The generation's rules plus an equal-name rule for every parameter they leave out.

        Like PaddleFormers' own loaders, a parameter no declared rule names loads from the
        checkpoint tensor of the same name under the base model's prefix (all of them on 0.4;
        e.g. an o_proj bias of ERNIE 4.5 that 1.x's mapping leaves out); checkpoints store
        linears ``[out, in]``, PaddleFormers' ``nn.Linear`` holds ``[in, out]``.
        """
        linear_weights = {f"{path}.weight" for path, layer in self.model.named_sublayers() if type(layer) is nn.Linear}
        # HF checkpoints keep the base model under "model." whatever PaddleFormers calls it (0.4's
        # Llama says base_model_prefix="llama")
        prefix = HF_BASE_PREFIX
        targets = {r.dest for r in rules if r.dest is not None}
        rules = list(rules)
        for name, _ in self.model.named_parameters():
            if name not in targets:
                rules.append(Rule([f"{prefix}.{name}" if prefix else name], name, "copy", [name in linear_weights]))
        self._hf_prefix = prefix
        return rules

    def _swap_moe(self, architecture: str) -> None:
        """Replace PaddleFormers' MoE blocks by the core's (:mod:`fd_paddleformers.moe`) and route their tensors."""
        for index, layer in enumerate(getattr(self.model, "layers", None) or []):
            mlp = getattr(layer, "mlp", None)
            if mlp is None or not is_moe_block(mlp):
                continue
            spec = router_spec(self.target.family, self.config)
            if spec is None:
                raise UnsupportedArchitectureError(
                    f"the PaddleFormers fallback cannot serve {architecture}: its mixture-of-experts router is not "
                    "one the core MoE layer implements (Qwen3-MoE's, ERNIE-4.5-MoE's and DeepSeek-V3's are)"
                )
            path = f"layers.{index}.mlp"
            shared = getattr(mlp, "shared_experts", None)
            layer.mlp = make_block(spec, self.hidden_size, shared, self.quant_config, prefix=f"model.{path}")
            kept = f"{path}.shared_experts."
            self.rules = [r for r in self.rules if not (r.dest or "").startswith(f"{path}.") or r.dest.startswith(kept)]
            hf_path = f"{self._hf_prefix}.{path}" if self._hf_prefix else path
            for source, dest, shard, transposed in checkpoint_sources(spec, hf_path, path):
                self.rules.append(Rule([source], dest, "copy", [transposed], shard=shard))

    def _check_rules(self, architecture: str) -> None:
        params = dict(self.model.named_parameters())
        targets = {r.dest for r in self.rules if r.dest is not None}
        stray = sorted(d for d in targets if d not in params and not d.startswith("lm_head."))
        if stray:
            raise UnsupportedArchitectureError(
                f"the PaddleFormers fallback cannot serve {architecture}: PaddleFormers' mapping names "
                f"parameters its base model does not have: {', '.join(stray[:5])}"
            )
        unnamed = sorted(p for p in params if p not in targets)
        if unnamed:
            raise UnsupportedArchitectureError(
                f"the PaddleFormers fallback cannot serve {architecture}: no checkpoint tensor maps to "
                f"{', '.join(unnamed[:5])}"
            )

    # ---- the model interface -----------------------------------------------------------------
    def forward(self, meta: ForwardMeta, kv_caches: list[tuple[paddle.Tensor, paddle.Tensor]]) -> paddle.Tensor:
        """Hidden states ``[T, H]`` of the step's flattened tokens (after the final norm)."""
        self._step.meta = meta
        self._step.kv_caches = kv_caches
        self._step.attention_calls = 0
        mla.set_step_length(self._latent_attention, int(meta.input_ids.shape[0]))
        try:
            embeds = self.model.embed_tokens(meta.input_ids).unsqueeze(0)
            with fallback_step():
                out = self.model(
                    inputs_embeds=embeds, position_ids=meta.positions.unsqueeze(0), use_cache=False, return_dict=False
                )
        finally:
            self._step.meta = None
            self._step.kv_caches = None
        if self._step.attention_calls != self.num_layers:
            raise UnsupportedArchitectureError(
                f"{type(self.model).__name__} ran {self._step.attention_calls} of its {self.num_layers} attention "
                "layers through the engine's paged attention; the others bypassed the KV cache"
            )
        hidden = out[0] if isinstance(out, (tuple, list)) else out.last_hidden_state
        return hidden.reshape([-1, self.hidden_size])

    def compute_logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        return self.lm_head(hidden)

    def kv_cache_spec(self) -> tuple[int, int, int]:
        """``(num_layers, num_kv_heads, head_dim)`` of the paged KV cache this model needs (this
        rank's KV heads when attention splits across tensor-parallel ranks)."""
        if self._latent_attention:
            return self.num_layers, self.num_kv_heads, self.head_dim
        return self.num_layers, self.num_local_kv_heads, self.head_dim

    def load_weights(self, weights: Iterable[tuple[str, np.ndarray]]) -> None:
        """Load HF-named checkpoint tensors through PaddleFormers' mapping rules.

        Raises :class:`ModelLoadError` for a tensor no rule takes, a shape mismatch, or
        parameters the checkpoint did not provide.
        """
        params = dict(self.model.named_parameters())
        by_source: dict[str, list[Rule]] = {}
        for rule in self.rules:
            for source in rule.sources:
                by_source.setdefault(source, []).append(rule)
        pending: dict[int, dict[str, np.ndarray]] = {}
        unexpected: list[str] = []
        head_loaded = False
        embed_source = next((r.sources[0] for r in self.rules if r.dest == "embed_tokens.weight"), None)

        expected: dict[str, set] = {}
        for rule in self.rules:
            if rule.dest in params:
                expected.setdefault(rule.dest, set()).add(rule.shard)
        loaded: dict[str, set] = {}

        def put(dest: str, array: np.ndarray, transposed: bool, shard: str | None = None) -> None:
            param = params[dest]
            loader = getattr(param, "weight_loader", None)
            try:
                if loader is not None:
                    if not transposed and dest in self._linear_weights and array.ndim == 2:
                        array = array.T  # stored [in, out]; the core linear loader takes [out, in]
                    loader(param, array, shard)
                else:
                    value = np.asarray(array.T if transposed and array.ndim == 2 else array, dtype=np.float32)
                    if tuple(value.shape) != tuple(param.shape):
                        raise ModelLoadError(f"checkpoint shape {value.shape}, parameter shape {tuple(param.shape)}")
                    param.set_value(value)
            except ModelLoadError as exc:
                raise ModelLoadError(f"tensor for {dest}: {exc.message}") from None
            loaded.setdefault(dest, set()).add(shard)

        for name, array in weights:
            if name.endswith(IGNORED_SUFFIXES) or (self._skipped_prefixes and name.startswith(self._skipped_prefixes)):
                continue
            if name == "lm_head.weight":
                if not self.tie_word_embeddings:
                    self.lm_head.weight.weight_loader(self.lm_head.weight, array)
                    head_loaded = True
                continue  # a tied head is the embedding; HF ignores a stored copy as well
            rules = by_source.get(name)
            if not rules:
                unexpected.append(name)
                continue
            if name == embed_source and self.tie_word_embeddings:
                self.lm_head.weight.weight_loader(self.lm_head.weight, array)
                head_loaded = True
            for rule in rules:
                if rule.dest is None or rule.dest.startswith("lm_head."):
                    continue
                if rule.kind == "copy":
                    put(rule.dest, array, rule.transposed[0], rule.shard)
                    continue
                parts = pending.setdefault(id(rule), {})
                parts[name] = array
                if len(parts) == len(rule.sources):
                    put(rule.dest, fuse(rule, [parts[s] for s in rule.sources]), rule.transposed[0], rule.shard)
                    del pending[id(rule)]
        if unexpected:
            raise ModelLoadError(
                f"checkpoint has {len(unexpected)} tensors PaddleFormers' {self.target.family} mapping has no place "
                f"for, e.g. {', '.join(unexpected[:5])}"
            )
        missing = sorted(p for p in params if loaded.get(p, set()) != expected.get(p, {None}))
        if not head_loaded:
            missing.append("lm_head.weight")
        if missing:
            raise ModelLoadError(
                f"checkpoint lacks {len(missing)} tensors the model needs, e.g. {', '.join(missing[:5])}"
            )
        for layer in self.sublayers():
            method = getattr(layer, "quant_method", None)
            if isinstance(method, LinearMethodBase):
                method.process_weights_after_loading(layer)

    # ---- selection ---------------------------------------------------------------------------
    @classmethod
    def supports(cls, hf_config: dict) -> tuple[bool, str]:
        """``(True, family)`` when the fallback can serve ``hf_config``, else ``(False, why)``.

        Checks everything short of building the model: PaddleFormers knows the architecture,
        its module imports here, its checkpoint mapping is loadable, no sliding-window attention.
        """
        try:
            target, _, _ = check_servable(hf_config)
        except NotServableError as exc:
            return False, str(exc)
        return True, f"PaddleFormers {target.base_model_cls.__name__} ({target.module})"
