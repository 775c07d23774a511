"""Load a Llama-family or Gemma 3 model from a local Hugging Face directory (never a hub).

Reads config.json and every *.safetensors file (through model.safetensors.index.json when
the checkpoint is sharded) one tensor at a time, fuses q/k/v and gate/up, and returns the
model on the chosen device and dtype, with weight-only int8/int4 quantization at load
when asked.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from tierguard.common.errors import TierguardError
from tierguard.model.config import ModelConfig
from tierguard.model.gemma3 import Gemma3Model
from tierguard.model.llama import LlamaModel
from tierguard.model.qlinear import WEIGHT_DTYPES
from tierguard.model.quantize import WeightQuantizer, release_free_memory

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


class _Checkpoint:
    """The checkpoint's tensors by name, read one at a time on demand (never all at
    once: with quantization at load, memory holds one float tensor beside the model)."""

    def __init__(self, model_dir: Path) -> None:
        self._files = []
        self._where: dict[str, object] = {}
        for path in _weight_files(model_dir):
            if not path.is_file():
                raise TierguardError(f"weight shard {path} listed in the index is missing")
            f = safe_open(str(path), framework="pt")
            self._files.append(f)
            for name in f.keys():
                self._where[name] = f

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def take(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise TierguardError(f"checkpoint lacks tensor {name!r}")
        return self._where[name].get_tensor(name)

    def read(self, names: list[str]) -> torch.Tensor:
        """One tensor, or several stacked by rows (a fused weight)."""
        return self.take(names[0]) if len(names) == 1 else torch.cat([self.take(n) for n in names])


def _fused_names(ckpt: _Checkpoint, cfg: ModelConfig) -> Iterator[tuple[str, list[str]]]:
    """LlamaModel's tensor names (fused qkv and gate_up, no "model." prefix), each with
    the checkpoint tensors it is made of."""
    yield "norm.weight", ["model.norm.weight"]
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", ["lm_head.weight" if "lm_head.weight" in ckpt else "model.embed_tokens.weight"]
    yield "embed_tokens.weight", ["model.embed_tokens.weight"]
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        att, mlp = src + "self_attn.", src + "mlp."
        yield dst + "self_attn.qkv_proj.weight", [att + f"{p}_proj.weight" for p in "qkv"]
        if cfg.qkv_bias:
            yield dst + "self_attn.qkv_proj.bias", [att + f"{p}_proj.bias" for p in "qkv"]
        yield dst + "self_attn.o_proj.weight", [att + "o_proj.weight"]
        if cfg.o_bias:
            yield dst + "self_attn.o_proj.bias", [att + "o_proj.bias"]
        if cfg.qk_norm:
            yield dst + "self_attn.q_norm.weight", [att + "q_norm.weight"]
            yield dst + "self_attn.k_norm.weight", [att + "k_norm.weight"]
        yield dst + "mlp.gate_up_proj.weight", [mlp + "gate_proj.weight", mlp + "up_proj.weight"]
        yield dst + "mlp.down_proj.weight", [mlp + "down_proj.weight"]
        yield dst + "input_layernorm.weight", [src + "input_layernorm.weight"]
        yield dst + "post_attention_layernorm.weight", [src + "post_attention_layernorm.weight"]
        if cfg.is_gemma3:
            yield dst + "self_attn.q_norm.weight", [att + "q_norm.weight"]
            yield dst + "self_attn.k_norm.weight", [att + "k_norm.weight"]
            for norm in ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"):
                yield dst + norm, [src + norm]


def model_class(cfg: ModelConfig) -> type[LlamaModel]:
    return Gemma3Model if cfg.is_gemma3 else LlamaModel


def load_model(
    model_dir: str | Path,
    dtype: str = "auto",
    device: str = "auto",
    weight_dtype: str = "auto",
    int4_group: int = 32,
    gguf_path: str | Path | None = None,
) -> tuple[LlamaModel, ModelConfig, torch.dtype, torch.device]:
    """The model on `device`, float weights in `dtype`; with `weight_dtype` int8 or int4
    the linear layers and the embedding are quantized tensor by tensor as they are read
    (tierguard/model/quantize.py), so no float copy of the whole model is ever held.
    `gguf_path`: the GGUF file `model_dir` was imported from; int4 layers whose blocks
    are Q4_0/Q4_1 and int8 ones (the embedding with int4 too) whose blocks are Q8_0 are
    then taken from it as they are (tierguard/model/gguf_quant.py)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise TierguardError(f"model directory {model_dir} does not exist")
    if weight_dtype not in WEIGHT_DTYPES:
        raise TierguardError(f"--weight-dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {weight_dtype!r}")
    cfg = ModelConfig.from_dir(model_dir)
    torch_dtype = resolve_dtype(dtype, cfg)
    dev = resolve_device(device)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    quant = None
    if weight_dtype != "auto":
        quant = WeightQuantizer(weight_dtype, int4_group, dev, torch_dtype)
        if gguf_path is not None:
            from tierguard.model.gguf_quant import GGUFBlocks

            quant.source = GGUFBlocks(gguf_path)
    ckpt = _Checkpoint(model_dir)
    for name, parts in _fused_names(ckpt, cfg):
        if quant is not None and quant.wants(name):
            if not quant.place_from_source(model, name, parts):
                quant.place(model, name, ckpt.read(parts))
        else:
            tensor = ckpt.read(parts).to(device=dev, dtype=torch_dtype)
            if quant is not None and tensor.device.type == "cpu":
                # safetensors hands out views of its memory map, and one kept view (a norm)
                # keeps the whole file mapped: every page the quantizer read stays in RSS
                # beside the int8/int4 copy. A quantized model owns its few float tensors.
                tensor = tensor.clone()
            set_tensor(model, name, tensor)
    del ckpt  # the file mappings go with the last reference
    finish_load(model, cfg, dev, quant)
    model.weight_dtype = weight_dtype
    return model, cfg, torch_dtype, dev


def set_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    if attr not in module._parameters:
        raise TierguardError(f"model has no parameter {name!r}")
    module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)


def finish_load(model: LlamaModel, cfg: ModelConfig, dev: torch.device, quant: WeightQuantizer | None) -> None:
    """Checks every parameter was loaded, ties a quantized embedding to the lm_head,
    rebuilds the rotary tables (they were built on "meta"; float32, cast per use, like
    the reference implementation) and hands freed float memory back to the OS."""
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise TierguardError(f"checkpoint lacks tensors for {missing[:3]}")
    if quant is not None:
        quant.finish(model)
    model.make_rotary(dev)
    model.eval()
    release_free_memory()
