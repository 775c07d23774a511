"""int4 / int8 layers straight from a GGUF file's Q4_0 / Q4_1 / Q8_0 blocks (no float32
on the way).

Why: SmolLM2 ships as Q4_1. Its import (gguf_import.py) dequantizes every tensor to
float32; quantizing those floats again at load costs time and memory and is only nearly
lossless. The block layout of Q4_1 is the layout of qlinear.Int4Linear with group 32
(per block: float16 d, float16 m, 16 bytes whose low nibbles are elements 0..15 and high
nibbles 16..31; w = q d + m), so the bytes are used as they are: scale = d, lo = m.
Q4_0 (float16 d, 16 bytes; w = (q - 8) d) gives scale = d, lo = -8 d, exact in float16.

Rows are only re-ordered: llama.cpp's "llama" architecture stores q/k rows permuted per
head (gguf_reader.unpermute_qk puts them back); blocks run along a row, so the packed
bytes and the per-block scales move with their rows.

Q8_0 (float16 d, 32 int8; w = q d) is qlinear.Int8Linear's layout: q = the 32 bytes,
scale = d. SmolLM2's embedding (and so its tied lm_head) is Q8_0: taken as it is, the
int8 embedding is the file's, bit for bit. Other types (Q4 into int8, K-quants) go
through float32 and are quantized at load.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tierguard.model import gguf_reader as gr
from tierguard.model.qlinear import Int4Linear, Int8Linear

BLOCK = 32
_LAYOUTS = {"Q4_1": 20, "Q4_0": 18, "Q8_0": 34}  # bytes per block of 32
KINDS = {"int4": ("Q4_0", "Q4_1"), "int8": ("Q8_0",)}  # the GGUF types each layer kind takes as is


def gguf_source(spec: str | Path) -> Path | None:
    """The GGUF file behind a `--model` spec ('smollm2', 'gemma3' or FILE.gguf), else None."""
    from tierguard.model.registry import builtin_gguf, is_gguf

    if str(spec) in ("smollm2", "gemma3"):
        return builtin_gguf(str(spec))
    path = Path(str(spec)).expanduser()
    return path if path.is_file() and is_gguf(path) else None


class GGUFBlocks:
    """int4 / int8 layers by HF tensor names, read from the file's Q4_0 / Q4_1 / Q8_0 blocks."""

    def __init__(self, path: str | Path) -> None:
        self.reader = gr.open_gguf(path)
        self.config = gr.hf_config(self.reader)
        self.permuted = gr.ARCHITECTURES[gr.architecture(self.reader)][2]
        self.tensors = {}
        arch = gr.architecture(self.reader)
        for t in self.reader.tensors:
            name = gr.hf_tensor_name(t.name, arch)
            if name is not None:
                self.tensors[name] = t

    def covers(self, names: list[str], kind: str) -> bool:
        """Whether every tensor is stored in a block type that layer `kind` takes as is."""
        return all(n in self.tensors and self.tensors[n].tensor_type.name in KINDS[kind] for n in names)

    def _unpermute(self, name: str, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
        if self.permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self.config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            return tuple(gr.unpermute_qk(a, heads) for a in arrays)
        return arrays

    def blocks(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(packed [N, K/2] uint8, scale [N, K/32] float16, lo [N, K/32] float16) in HF row order."""
        t = self.tensors[name]
        n, k = gr.hf_shape(t)
        raw = np.asarray(t.data).reshape(n, k // BLOCK, _LAYOUTS[t.tensor_type.name])
        d = raw[..., 0:2].copy().view(np.float16)[..., 0]
        if t.tensor_type.name == "Q4_1":
            lo = raw[..., 2:4].copy().view(np.float16)[..., 0]
            qs = raw[..., 4:]
        else:
            lo = (d.astype(np.float32) * -8.0).astype(np.float16)
            qs = raw[..., 2:]
        packed = np.ascontiguousarray(qs).reshape(n, k // 2)
        return self._unpermute(name, packed, d, lo)

    def blocks_q8(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(q [N, K] int8, scale [N, K/32] float16) of a Q8_0 tensor, in HF row order."""
        t = self.tensors[name]
        n, k = gr.hf_shape(t)
        raw = np.asarray(t.data).reshape(n, k // BLOCK, _LAYOUTS["Q8_0"])
        d = raw[..., 0:2].copy().view(np.float16)[..., 0]
        q = np.ascontiguousarray(raw[..., 2:]).view(np.int8).reshape(n, k)
        return self._unpermute(name, q, d)

    def linear(
        self, names: list[str], kind: str, bias: torch.Tensor | None = None
    ) -> Int4Linear | Int8Linear:
        """One `kind` layer from these tensors stacked by rows (fused q/k/v or gate/up)."""
        if kind == "int8":
            parts = [self.blocks_q8(n) for n in names]
            q, scale = (torch.from_numpy(np.concatenate([p[i] for p in parts])) for i in range(2))
            return Int8Linear(q, scale, bias)
        parts = [self.blocks(n) for n in names]
        packed, scale, lo = (torch.from_numpy(np.concatenate([p[i] for p in parts])) for i in range(3))
        return Int4Linear(packed, scale, lo, BLOCK, bias)
