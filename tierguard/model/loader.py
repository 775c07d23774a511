"""Load a Llama-family model from a local Hugging Face directory (never a hub).

Reads config.json and every *.safetensors file (through model.safetensors.index.json when
the checkpoint is sharded), fuses q/k/v and gate/up, and returns the model on the chosen
device and dtype.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from tierguard.common.errors import TierguardError
from tierguard.model.config import ModelConfig
from tierguard.model.layers import RotaryEmbedding
from tierguard.model.llama import LlamaModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, cfg: ModelConfig) -> torch.dtype:
    """ "auto" means the checkpoint's torch_dtype."""
    name = cfg.torch_dtype if dtype == "auto" else dtype
    name = name.replace("torch.", "")
    if name not in DTYPES:
        raise TierguardError(f"unsupported dtype {name!r}: choose auto, float32, bfloat16 or float16")
    return DTYPES[name]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise TierguardError(f"device {device!r} requested but CUDA is not available")
    return torch.device(device)


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise TierguardError(f"no *.safetensors weights in {model_dir}")
    return files


def _read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in _weight_files(model_dir):
        if not path.is_file():
            raise TierguardError(f"weight shard {path} listed in the index is missing")
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def _fused_state_dict(raw: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Map HF names onto LlamaModel's (fused qkv and gate_up, no "model." prefix)."""

    def take(name: str) -> torch.Tensor:
        if name not in raw:
            raise TierguardError(f"checkpoint lacks tensor {name!r}")
        return raw[name]

    out: dict[str, torch.Tensor] = {
        "embed_tokens.weight": take("model.embed_tokens.weight"),
        "norm.weight": take("model.norm.weight"),
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = raw.get("lm_head.weight", out["embed_tokens.weight"])
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        att = src + "self_attn."
        out[dst + "self_attn.qkv_proj.weight"] = torch.cat([take(att + f"{p}_proj.weight") for p in "qkv"])
        if cfg.qkv_bias:
            out[dst + "self_attn.qkv_proj.bias"] = torch.cat([take(att + f"{p}_proj.bias") for p in "qkv"])
        out[dst + "self_attn.o_proj.weight"] = take(att + "o_proj.weight")
        if cfg.o_bias:
            out[dst + "self_attn.o_proj.bias"] = take(att + "o_proj.bias")
        if cfg.qk_norm:
            out[dst + "self_attn.q_norm.weight"] = take(att + "q_norm.weight")
            out[dst + "self_attn.k_norm.weight"] = take(att + "k_norm.weight")
        mlp = src + "mlp."
        out[dst + "mlp.gate_up_proj.weight"] = torch.cat(
            [take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")]
        )
        out[dst + "mlp.down_proj.weight"] = take(mlp + "down_proj.weight")
        out[dst + "input_layernorm.weight"] = take(src + "input_layernorm.weight")
        out[dst + "post_attention_layernorm.weight"] = take(src + "post_attention_layernorm.weight")
    return out


def load_model(
    model_dir: str | Path, dtype: str = "auto", device: str = "auto"
) -> tuple[LlamaModel, ModelConfig, torch.dtype, torch.device]:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise TierguardError(f"model directory {model_dir} does not exist")
    cfg = ModelConfig.from_dir(model_dir)
    torch_dtype = resolve_dtype(dtype, cfg)
    dev = resolve_device(device)
    state = _fused_state_dict(_read_tensors(model_dir), cfg)
    with torch.device("meta"):
        model = LlamaModel(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    model = model.to(device=dev, dtype=torch_dtype)
    # Rotary tables were built on "meta"; rebuild them for real, in float32 (cast per use,
    # like the reference implementation).
    model.rotary = RotaryEmbedding(
        cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, dev
    )
    model.eval()
    return model, cfg, torch_dtype, dev
