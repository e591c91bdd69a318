"""Parse a Hugging Face model directory into a `ModelSpec` (Llama, Mistral, Qwen2, Qwen3, Gemma 3,
Qwen3-MoE, Qwen3.5 dense and MoE).

A new family adds its `model_type` to `FAMILIES` (and `_ARCHITECTURES`), reads its own keys
here, and says what each layer is (`LayerKind`); each side maps the type to its code in one
registry line (`nodes/prefill/families`, `nodes/decode/families`).

Config traps (DESIGN.md, "Facts"): `rope_theta` may stand at the top level or only inside
`rope_parameters`; a missing `tie_word_embeddings` means different things per family. Gemma 3's
own keys (layer kinds, two RoPE thetas) are read in `gemma3_config.py`, Qwen3.5's (nested
`text_config`, linear attention) in `qwen3_5_config.py`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tandem.nodes.model.deepseek_config import MlaSpec, deepseek_fields
from tandem.nodes.model.errors import ModelError
from tandem.nodes.model.gemma3_config import read_gemma3
from tandem.nodes.model.glm4_config import glm4_fields
from tandem.nodes.model.gpt_oss_config import read_gpt_oss
from tandem.nodes.model.locate import model_name
from tandem.nodes.model.quant import QuantConfig, parse_quantization
from tandem.nodes.model.qwen3_5_config import (
    LinearSpec,
    canonical_name,
    read_qwen3_5,
    text_keys,
)
from tandem.nodes.model.rope_config import RopeScaling, rope_scaling, rope_theta

Family = Literal[
    "llama", "mistral", "qwen2", "qwen3", "gemma3_text", "qwen3_moe", "qwen3_5", "qwen3_5_moe",
    "gpt_oss", "glm4_moe", "deepseek_v3",
]  # fmt: skip
FAMILIES: tuple[Family, ...] = (
    "llama", "mistral", "qwen2", "qwen3", "gemma3_text", "qwen3_moe", "qwen3_5", "qwen3_5_moe",
    "gpt_oss", "glm4_moe", "deepseek_v3",
)  # fmt: skip
ALIASES: dict[str, Family] = {"kimi_k2": "deepseek_v3"}  # as mlx-lm's MODEL_REMAPPING

YARN_FAMILIES = ("gpt_oss", "deepseek_v3")  # whose prefill does YaRN (mscale in `begin`)
# What `transformers` assumes when `tie_word_embeddings` is absent. mlx-lm's llama.py assumes
# True instead (DESIGN.md trap), so the decode side must be told explicitly.
_TIE_DEFAULT: dict[Family, bool] = {**dict.fromkeys(FAMILIES, False), "gemma3_text": True}
_ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3_text",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "GptOssForCausalLM": "gpt_oss",
    "Glm4MoeForCausalLM": "glm4_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


@dataclass(frozen=True)
class LayerKind:
    """What a layer's attention keeps, which both sides build their per-layer state from.

    - "full": K/V of every position (decode: a `KVCache`);
    - "sliding": K/V of the last `window` positions only (decode: a
      `RotatingKVCache(max_size=window)`);
    - "linear": no K/V, a fixed-size state (linear attention: conv and recurrent arrays);
    - "latent": multi-head latent attention (DeepSeek V3): per position the normed latent
      and the shared roped key, as mlx-lm's `KVCache` holds them (keys, values).
    """

    kind: Literal["full", "sliding", "linear", "latent"] = "full"
    window: int | None = None  # positions kept: "sliding" only

    def __post_init__(self) -> None:
        if (self.kind == "sliding") != (self.window is not None):
            raise ValueError(
                f"a {self.kind} layer takes {'a' if self.kind == 'sliding' else 'no'} window"
            )
        if self.window is not None and self.window < 1:
            raise ValueError(f"window {self.window} is not positive")


FULL = LayerKind()


@dataclass(frozen=True)
class MoeSpec:
    """A mixture of experts' shape (Qwen3-MoE, Qwen3.5-MoE): which layers route, and how."""

    num_experts: int
    experts_per_token: int  # top-k
    intermediate_size: int  # each expert's
    norm_topk_prob: bool  # the top-k weights renormalised to sum to 1
    sparse: tuple[bool, ...]  # per layer: its MLP is the experts (else a dense MLP)
    # a shared expert's width (Qwen3.5): every token also goes through one SwiGLU MLP
    # (`mlp.shared_expert.*`), scaled by sigmoid(`mlp.shared_expert_gate` [1, H] · x); 0: none.
    # GLM-4.x, DeepSeek V3: `mlp.shared_experts.*`, n_shared_experts × an expert's width, no gate
    shared_intermediate_size: int = 0
    # the DeepSeek-V3 lineage's router (`topk_method: noaux_tc`): sigmoid scores, a correction
    # bias added for the choice only, the choice limited to the best `topk_groups` of `groups`
    # groups of experts, the chosen weights scaled by `routed_scaling`
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    groups: int = 1
    topk_groups: int = 1
    routed_scaling: float = 1.0

    def expected_share(self, tokens: int) -> float:
        """The share of a layer's experts that `tokens` tokens are expected to choose, each
        its top-k of E, taken as independent and uniform: 1 - (1 - k/E)^tokens (a real
        router is skewed, and chooses fewer)."""
        if not self.num_experts:
            return 1.0
        return 1.0 - (1.0 - self.experts_per_token / self.num_experts) ** max(tokens, 0)


def _moe(config: dict[str, Any], layers: int) -> MoeSpec:
    """mlx-lm's rule: layer i routes unless in `mlp_only_layers`, where experts exist and
    (i + 1) is a multiple of `decoder_sparse_step`."""
    experts = int(config["num_experts"])
    step = int(config.get("decoder_sparse_step") or 1)
    only = {int(i) for i in config.get("mlp_only_layers") or []}
    sparse = tuple(i not in only and experts > 0 and (i + 1) % step == 0 for i in range(layers))
    top_k = int(config["num_experts_per_tok"])
    if experts and not 1 <= top_k <= experts:
        raise ValueError(f"num_experts_per_tok {top_k} of {experts} experts")
    return MoeSpec(
        experts, top_k, int(config["moe_intermediate_size"]),
        bool(config.get("norm_topk_prob", False)), sparse,
    )  # fmt: skip


@dataclass(frozen=True)
class ModelSpec:
    """Everything the prefill and decode sides need to know about a model's shape."""

    path: Path
    name: str
    family: Family
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    max_position_embeddings: int
    torch_dtype: str  # as written in config.json, e.g. "bfloat16"
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    quantization: QuantConfig = field(default_factory=lambda: QuantConfig(None, {}), hash=False)
    layer_kinds: tuple[LayerKind, ...] = ()  # one per layer; () reads as all "full"
    rope_local_theta: float | None = None  # "sliding" layers' RoPE base (Gemma 3), unscaled
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power; None: D
    hidden_act: str = "silu"  # the MLP gate's activation ("gelu_pytorch_tanh": Gemma 3)
    post_norms: bool = False  # four norms per layer: each branch's output normed too (Gemma 3)
    moe: MoeSpec | None = None  # a mixture of experts (Qwen3-MoE, Qwen3.5-MoE)
    linear: LinearSpec | None = None  # the "linear" layers' gated delta net (Qwen3.5)
    partial_rotary_factor: float = 1.0  # RoPE turns the first int(head_dim * this) dims
    # q_proj [2 * heads * D, H] gives per head [q (D), gate (D)]; the attention output is
    # multiplied by sigmoid(gate) before o_proj (Qwen3.5)
    attn_output_gate: bool = False
    attention_sinks: bool = False  # a learned logit per query head in every softmax (gpt-oss)
    mla: MlaSpec | None = None  # multi-head latent attention's widths (DeepSeek V3)
    output_bias: bool = False  # o_proj has a bias (gpt-oss)

    def __post_init__(self) -> None:
        if not self.layer_kinds:  # today's families: every layer attends to every position
            object.__setattr__(self, "layer_kinds", (FULL,) * self.num_layers)
        if len(self.layer_kinds) != self.num_layers:
            raise ValueError(f"{len(self.layer_kinds)} layer kinds for {self.num_layers} layers")

    @property
    def float_kv(self) -> bool:
        """mlx-lm holds this model's cache in float only: attention sinks (gpt-oss) or latent
        layers (DeepSeek V3) cannot attend a quantized one."""
        return self.attention_sinks or self.mla is not None

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all layers, in the model dtype (bytes)."""
        itemsize = 4 if self.torch_dtype == "float32" else 2
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelError(f"{path}: expected a JSON object")
    return data


def _family(config: dict[str, Any], where: Path) -> Family:
    model_type = config.get("model_type")
    if model_type in FAMILIES:
        return model_type
    if model_type in ALIASES:
        return ALIASES[model_type]
    # mlx-lm picks the model class by model_type alone; consult `architectures` only when
    # there is none, or the two sides could run different models.
    if model_type is None:
        for arch in config.get("architectures") or []:
            if arch in _ARCHITECTURES:
                return _ARCHITECTURES[arch]
    raise ModelError(
        f"{where}: unsupported architecture (model_type={model_type!r}); "
        f"tandem supports {', '.join(FAMILIES)}"
    )


def _eos_ids(config: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    eos = generation.get("eos_token_id", config.get("eos_token_id"))
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)


def _gemma3_fields(config: dict[str, Any], where: Path) -> dict[str, Any]:
    """The ModelSpec fields a Gemma 3 config sets otherwise than the dense families'."""
    keys = read_gemma3(config, where)
    return {
        "layer_kinds": tuple(
            LayerKind("sliding", keys.window) if sliding else FULL for sliding in keys.sliding
        ),
        "rope_theta": keys.rope_theta,
        "rope_local_theta": keys.rope_local_theta,
        # mlx-lm scales the global layers by the top-level key only
        "rope_scaling": rope_scaling({"rope_scaling": config.get("rope_scaling")}, where),
        "head_dim": keys.head_dim,
        "num_kv_heads": keys.num_kv_heads,
        "query_pre_attn_scalar": keys.query_pre_attn_scalar,
        "hidden_act": keys.hidden_act,
        "max_position_embeddings": int(config.get("max_position_embeddings") or 32768),
        "qk_norm": True,
        "post_norms": True,
    }


def _qwen3_5_fields(config: dict[str, Any], where: Path) -> dict[str, Any]:
    """The ModelSpec fields a Qwen3.5 config sets otherwise than the dense families' (its
    text keys: `config` is flattened already)."""
    keys = read_qwen3_5(config, where)
    layers = len(keys.linear_layers)
    fields: dict[str, Any] = {
        "layer_kinds": tuple(LayerKind("linear") if lin else FULL for lin in keys.linear_layers),
        "linear": keys.linear,
        "rope_theta": keys.rope_theta,
        "rope_scaling": rope_scaling({"rope_scaling": keys.rope_parameters}, where),
        "partial_rotary_factor": keys.partial_rotary_factor,
        "attn_output_gate": True,
        "qk_norm": True,
        "max_position_embeddings": int(config.get("max_position_embeddings") or 131072),
    }
    if int(config.get("num_experts") or 0) > 0:  # mlx-lm: then every layer routes
        moe = _moe({"norm_topk_prob": True, **config, "mlp_only_layers": []}, layers)
        fields["moe"] = MoeSpec(
            moe.num_experts, moe.experts_per_token, moe.intermediate_size, moe.norm_topk_prob,
            (True,) * layers, int(config.get("shared_expert_intermediate_size") or 0),
        )  # fmt: skip
    return fields


def _gpt_oss_fields(config: dict[str, Any], where: Path) -> dict[str, Any]:
    """The ModelSpec fields a gpt-oss config sets otherwise than the dense families'."""
    keys = read_gpt_oss(config, where)
    return {
        "layer_kinds": tuple(
            LayerKind("sliding", keys.window) if s else FULL for s in keys.sliding
        ),
        "moe": MoeSpec(
            keys.experts, keys.top_k, keys.expert_width, True, (True,) * len(keys.sliding)
        ),
        "attention_bias": True,
        "output_bias": True,
        "attention_sinks": True,
        "rms_norm_eps": float(config.get("rms_norm_eps") or 1e-5),
        "max_position_embeddings": int(config.get("max_position_embeddings") or 131072),
    }


def _canonical_quant(quant: QuantConfig) -> QuantConfig:
    """The overrides keyed by canonical module paths (mlx-lm writes `language_model.model.*`)."""
    overrides = {canonical_name(k): q for k, q in quant.overrides.items()}
    kept = {k: q for k, q in overrides.items() if k is not None}
    return dataclasses.replace(quant, overrides=kept)


def load_spec(model_dir: str | Path) -> ModelSpec:
    """Read `config.json` (and `generation_config.json` if present) into a ModelSpec."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelError(f"{path}: not a model directory")
    where = path / "config.json"
    config = _read_json(where)
    gen_path = path / "generation_config.json"
    generation = _read_json(gen_path) if gen_path.exists() else {}
    family = _family(config, where)
    extra = _gemma3_fields(config, where) if family == "gemma3_text" else {}
    if family == "gpt_oss":
        extra = _gpt_oss_fields(config, where)
    if family == "glm4_moe":
        extra = glm4_fields(config, where)
    if family == "deepseek_v3":
        extra = deepseek_fields(config, where)
    if family in ("qwen3_5", "qwen3_5_moe"):
        config = text_keys(config)
        config.setdefault("intermediate_size", 14336)  # mlx-lm's default; unused by MoE
        extra = _qwen3_5_fields(config, where)
    try:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        fields: dict[str, Any] = dict(
            path=path,
            name=model_name(path),  # a hub snapshot's id, not its commit-hash folder
            family=family,
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=extra.get("rope_theta") or rope_theta(config),
            rope_scaling=rope_scaling(config, where),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", _TIE_DEFAULT[family])),
            attention_bias=family == "qwen2" or bool(config.get("attention_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"),
            eos_token_ids=_eos_ids(config, generation),
            bos_token_id=config.get("bos_token_id"),
            quantization=_canonical_quant(parse_quantization(config, str(where))),
        )
        if family == "qwen3_moe":
            extra = {"moe": _moe(config, fields["num_layers"])}
        spec = ModelSpec(**{**fields, **extra})
    except KeyError as e:
        raise ModelError(f"{where}: missing key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ModelError(f"{where}: malformed value ({e})") from None
    scaling = spec.rope_scaling
    if scaling is not None and scaling.kind == "yarn" and family not in YARN_FAMILIES:
        raise ModelError(f"{where}: unsupported rope scaling type 'yarn' for {family}")
    if spec.num_heads % spec.num_kv_heads:
        raise ModelError(f"{where}: num_attention_heads is not a multiple of num_key_value_heads")
    if spec.num_layers <= 0 or spec.hidden_size <= 0:
        raise ModelError(f"{where}: num_hidden_layers and hidden_size must be positive")
    return spec
