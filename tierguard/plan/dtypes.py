"""Element sizes of KV-cache and weight formats, metadata included.

A format is stored as a block: `block_bytes` bytes hold `block_elems` values. Plain
types are blocks of one element; llama.cpp's quantized types are blocks of 32 values
with a scale inside the block. Per-token-head scales (int8 KV) are counted apart,
because they are paid per KV head per token, not per element.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tierguard.common.errors import TierguardError


@dataclass(frozen=True)
class KVFormat:
    """How one K or V element is stored in the cache."""

    name: str
    block_bytes: int
    block_elems: int
    # 4-byte scales paid per KV head per token per layer, once for K and once for V.
    scale_bytes_per_token_head: int = 0
    # Scales held outside the pages (fp8 per-tensor): counted as zero per token.
    note: str = ""

    @property
    def quantized(self) -> bool:
        return self.block_bytes / self.block_elems < 2

    def bytes_for(self, elems: int) -> int:
        """Bytes for `elems` values, rounding a partial block up (llama.cpp pads rows)."""
        return math.ceil(elems / self.block_elems) * self.block_bytes


def _plain(name: str, nbytes: int, note: str = "") -> KVFormat:
    return KVFormat(name, nbytes, 1, 0, note)


# Names users type, engine spellings included (vLLM, SGLang, llama.cpp).
KV_FORMATS: dict[str, KVFormat] = {
    "fp32": _plain("fp32", 4),
    "fp16": _plain("fp16", 2),
    "bf16": _plain("bf16", 2),
    "fp8": _plain("fp8", 1, "per-tensor scales outside the pages"),
    "fp8_e4m3": _plain("fp8_e4m3", 1, "per-tensor scales outside the pages"),
    "fp8_e5m2": _plain("fp8_e5m2", 1, "per-tensor scales outside the pages"),
    "int8": KVFormat("int8", 1, 1, 4, "4-byte scale per KV head per token for K and for V"),
    "fp8_per_token": KVFormat("fp8_per_token", 1, 1, 4, "4-byte scale per KV head per token for K and for V"),
    # NVFP4-style: 16 values of 4 bits plus one fp8 scale.
    "fp4_e2m1": KVFormat("fp4_e2m1", 9, 16, 0, "16 values + 1-byte block scale"),
    # llama.cpp ggml types: bytes per block of 32 values.
    "f32": KVFormat("f32", 128, 32),
    "f16": KVFormat("f16", 64, 32),
    "q8_0": KVFormat("q8_0", 34, 32, 0, "ggml block: 32 values + fp16 scale"),
    "q5_1": KVFormat("q5_1", 24, 32, 0, "ggml block"),
    "q5_0": KVFormat("q5_0", 22, 32, 0, "ggml block"),
    "q4_1": KVFormat("q4_1", 20, 32, 0, "ggml block"),
    "q4_0": KVFormat("q4_0", 18, 32, 0, "ggml block: 32 values + fp16 scale"),
    "iq4_nl": KVFormat("iq4_nl", 18, 32, 0, "ggml block"),
}
# Aliases users type.
_KV_ALIASES = {
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "float32": "fp32",
    "e4m3": "fp8_e4m3",
    "e5m2": "fp8_e5m2",
    "fp4": "fp4_e2m1",
}

# vLLM's fp8_ds_mla packs one MLA latent (512 fp8 + 4 fp32 scales + 64 bf16 rope) in 656 bytes.
FP8_DS_MLA_BYTES_PER_TOKEN_LAYER = 656

_TORCH_DTYPES = {
    "float32": "fp32",
    "float16": "fp16",
    "bfloat16": "bf16",
    "fp32": "fp32",
    "fp16": "fp16",
    "bf16": "bf16",
}


def model_dtype(torch_dtype: str | None) -> str:
    """The activation/KV dtype an engine picks for `auto`: fp32 checkpoints run in bf16."""
    name = _TORCH_DTYPES.get(str(torch_dtype or "bfloat16").lower(), "bf16")
    return "bf16" if name == "fp32" else name


def kv_format(name: str, torch_dtype: str | None = None) -> KVFormat:
    """Resolve `--kv-dtype`; `auto` means the model's own dtype."""
    key = str(name).strip().lower()
    if key == "auto":
        key = model_dtype(torch_dtype)
    if key == "fp8_ds_mla":
        return KVFormat("fp8_ds_mla", 1, 1, 0, "MLA only: 656 bytes per token per layer")
    key = _KV_ALIASES.get(key, key)
    if key not in KV_FORMATS:
        raise TierguardError(
            f"unknown KV dtype {name!r}: choose one of auto, fp8_ds_mla, " + ", ".join(KV_FORMATS)
        )
    return KV_FORMATS[key]


# Weight formats: bytes per parameter of a linear layer, scales included.
# int4 = AWQ/GPTQ 4-bit with an fp16 scale and a 4-bit zero per group of 128.
WEIGHT_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "fp16": 2.0,
    "bf16": 2.0,
    "fp8": 1.0,
    "int8": 1.0 + 2 / 128,
    "int4": 0.5 + (2 + 0.5) / 128,
    "mxfp4": 4.25 / 8,
    "nvfp4": 0.5 + 1 / 16,
    "q8_0": 34 / 32,
    "q6_k": 210 / 256,
    "q5_k_m": 5.69 / 8,
    "q4_k_m": 4.89 / 8,
    "q4_0": 18 / 32,
    "q3_k_m": 3.91 / 8,
    "q2_k": 84 / 256,
}
_GGUF = {"q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_0", "q3_k_m", "q2_k"}


@dataclass(frozen=True)
class WeightFormat:
    """Bytes per parameter for linear layers and for embeddings/norms."""

    name: str
    linear_bytes: float
    embed_bytes: float
    # MXFP4 checkpoints (gpt-oss) quantize only the MoE experts; attention, router and
    # embeddings stay 16 bit (their quantization_config lists them in modules_to_not_convert).
    experts_only: bool = False
    # vLLM lays MXFP4 expert weights out with the hidden dimension padded to a multiple of
    # 256 (2880 -> 3072 for gpt-oss): "Model loading took" is 13.47 GiB for gpt-oss-20b and
    # 64.38 GiB for gpt-oss-120b on H100 (v0.11), 6.7% above 4.25 bits per expert weight.
    expert_hidden_multiple: int = 1


def _compressed_tensors(quant: dict) -> str | None:
    """llm-compressor checkpoints (e.g. RedHatAI *-FP8-dynamic): read the weight scheme."""
    for group in (quant.get("config_groups") or {}).values():
        w = (group or {}).get("weights") or {}
        bits, kind = int(w.get("num_bits") or 0), str(w.get("type") or "")
        if bits == 8:
            return "fp8" if kind == "float" else "int8"
        if bits == 4:
            return "nvfp4" if kind == "float" else "int4"
    return None


def weight_format(name: str, torch_dtype: str | None = None, quant: dict | None = None) -> WeightFormat:
    """Resolve `--weights-dtype`; `auto` honours the checkpoint's quantization_config.

    Quantized checkpoints (vLLM style) keep embeddings and norms at 16 bit; GGUF types
    quantize the embeddings too.
    """
    key = str(name).strip().lower()
    base = model_dtype(torch_dtype)
    if key == "auto":
        method = str((quant or {}).get("quant_method", "")).lower()
        if method in ("fp8", "fbgemm_fp8"):
            key = "fp8"
        elif method in ("awq", "gptq", "awq_marlin", "gptq_marlin"):
            key = "int4" if int((quant or {}).get("bits", 4)) == 4 else "int8"
        elif method == "mxfp4":
            key = "mxfp4"
        elif method == "compressed-tensors":
            key = _compressed_tensors(quant or {}) or base
        else:
            key = base
    key = _KV_ALIASES.get(key, key)
    if key not in WEIGHT_BYTES:
        raise TierguardError(
            f"unknown weights dtype {name!r}: choose one of auto, " + ", ".join(WEIGHT_BYTES)
        )
    per = WEIGHT_BYTES[key]
    embed = per if key in _GGUF or per >= 2 else WEIGHT_BYTES[base]
    mx = key == "mxfp4"
    return WeightFormat(key, per, embed, experts_only=mx, expert_hidden_multiple=256 if mx else 1)
