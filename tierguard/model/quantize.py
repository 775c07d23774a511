"""Quantization at load: which tensors become bf16 / int8 / int4 modules, and how.

The loader hands tensors over one at a time (tierguard/model/loader.py); each linear
weight (fused q/k/v, o, fused gate/up, down, an untied lm_head) and the embedding is
quantized as it arrives and its float copy dropped, so the peak is one float tensor
beside the quantized model. Norms and biases stay in the model dtype.

int8 is group-wise (32 inputs per float16 scale, GGUF Q8_0's layout; qlinear.py) and
takes every shape. int4 needs K in whole groups; a tensor that does not fit is kept int8
and counted as such in `summary`. With int4 the embedding (and a tied or untied lm_head)
stays int8, as llama.cpp's Q4 files keep token_embd/output at 8 bits: an int4 embedding
alone loses much of the agreement with float32 that an int8 one keeps. bf16 rounds every
linear weight and the embedding to bfloat16 in the kernels' panel layout (Bf16Linear).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections import Counter

import torch
from torch import nn

from tierguard.model.qlinear import Bf16Linear, Int4Linear, Int8Linear, QuantEmbedding, QuantLinear

log = logging.getLogger(__name__)

LINEAR_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class WeightQuantizer:
    def __init__(self, weight_dtype: str, group: int, device: torch.device, dtype: torch.dtype) -> None:
        self.weight_dtype = weight_dtype
        self.group = group
        self.device = device
        self.dtype = dtype
        self.kinds: Counter[str] = Counter()  # what each tensor became
        self.source = None  # gguf_quant.GGUFBlocks: int4/int8 layers from the file's blocks

    def wants(self, name: str) -> bool:
        module, _, attr = name.rpartition(".")
        leaf = module.rpartition(".")[2]
        return attr == "weight" and (leaf in LINEAR_MODULES or module in ("lm_head", "embed_tokens"))

    def kind(self, shape: tuple[int, int], head: bool) -> str:
        """bf16, int8 or int4 for a weight of `shape`; `head`: the embedding or lm_head (int8
        with int4 weights)."""
        if self.weight_dtype == "bf16":
            return "bf16"
        if head or (self.weight_dtype == "int4" and not Int4Linear.supports(shape, self.group)):
            return "int8"
        return self.weight_dtype

    def linear(self, w: torch.Tensor, bias: torch.Tensor | None, head: bool = False) -> QuantLinear:
        """A quantized linear layer from a float weight [N, K]; `head`: the embedding or lm_head."""
        kind = self.kind(tuple(w.shape), head)
        self.kinds[kind] += 1
        if kind == "int4":
            return Int4Linear.from_float(w, self.group, bias).to(self.device)
        if kind == "bf16":
            return Bf16Linear.from_float(w.to(self.device), bias)
        return Int8Linear.from_float(w, bias).to(self.device)

    def _install(self, model: nn.Module, module_name: str, make) -> None:
        """Put `make(bias of the module it replaces)` in the place of `module_name`."""
        if module_name == "embed_tokens":
            model.embed_tokens = QuantEmbedding(make(None), self.dtype)
            return
        parent_name, _, child = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, make(getattr(parent, child).bias))

    def place(self, model: nn.Module, name: str, tensor: torch.Tensor) -> None:
        module_name = name.rpartition(".")[0]
        head = module_name in ("embed_tokens", "lm_head")
        self._install(model, module_name, lambda bias: self.linear(tensor, bias, head=head))

    def place_from_source(self, model: nn.Module, name: str, parts: list[str]) -> bool:
        """A layer made from the GGUF file's own blocks (True) when they are the layer's
        format: Q4_0/Q4_1 for int4 (group 32), Q8_0 for int8 (the embedding and lm_head
        included). Else False: the caller reads the float tensor."""
        module_name = name.rpartition(".")[0]
        head = module_name in ("embed_tokens", "lm_head")
        kind = "int8" if head else self.weight_dtype
        if self.source is None or (kind == "int4" and self.group != 32):
            return False
        if not self.source.covers(parts, kind):
            return False
        self._install(model, module_name, lambda bias: self.source.linear(parts, kind, bias).to(self.device))
        self.kinds[f"{kind} (GGUF blocks)"] += 1
        return True

    def finish(self, model: nn.Module) -> None:
        log.info("weights quantized at load: %s", self.summary())

    def summary(self) -> dict[str, int]:
        return dict(self.kinds)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's weights (parameters and buffers, quantized scales included),
    each storage counted once (a tied embedding is one matrix)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_meta:
            continue
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def release_free_memory() -> None:
    """Give memory freed by the float tensors back to the OS (glibc keeps freed heap
    chunks otherwise, and the RSS would not show what quantization saved)."""
    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass
