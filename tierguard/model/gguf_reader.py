"""Read a GGUF file as a Hugging Face model: config, tensor names, dequantized weights.

The pieces are separate functions so that a loader which keeps some tensors quantized
(Q8_0 / Q4_0 / Q4_1 blocks used as they are) can reuse the metadata, the name mapping
and the q/k row order without the dequantization:

- `open_gguf(path)`: the `gguf` package's reader; a file that is not GGUF, or is cut
  short, becomes one TierguardError naming the file.
- `hf_config(reader)`: config.json content from `general.architecture` and the
  `<arch>.*` keys; architectures the engine cannot run are refused by name.
- `hf_tensor_name(gguf_name)`: `blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`.
- `unpermute_qk(weight, n_heads)`: llama.cpp's "llama" architecture applies RoPE to
  adjacent pairs, HF to two halves; its converter re-orders q/k rows per head
  (`gguf_export.permute_for_gguf`), this puts them back.
- `iter_hf_tensors(reader, config)`: (hf name, float32 numpy array), one tensor at a
  time, so memory holds one dequantized tensor, never the model.

The file is memory-mapped by `gguf.GGUFReader`; nothing is read until a tensor is
dequantized.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tierguard.common.errors import TierguardError

# GGUF architecture -> (HF architecture, model_type, whether q/k rows are permuted).
# llama.cpp rotates adjacent pairs only for "llama"; qwen2/qwen3/gemma3 use the NEOX
# (halves) layout, like HF, so their rows are stored as HF has them.
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text", False),
}
# llama.cpp's gemma3 reader fixes what the file does not store: one global layer in six
# and a sliding-layer RoPE base of 10000.
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0

_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3 normalizes around both sublayers: its ffn_norm is the pre-FFN norm, and two
# post-norms have names of their own.
_GEMMA3_LAYER = {
    **_LAYER,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_LAYER_NAMES = {"gemma3": _GEMMA3_LAYER}
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors llama.cpp writes that a HF checkpoint recomputes (RoPE tables).
_IGNORED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def open_gguf(path: str | Path):
    """`gguf.GGUFReader` over `path`, or a one-line error naming what is wrong."""
    try:
        import gguf
    except ImportError as exc:
        raise TierguardError("reading GGUF needs the `gguf` package: pip install gguf") from exc
    path = Path(path)
    if not path.is_file():
        raise TierguardError(f"GGUF file {str(path)!r} does not exist")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise TierguardError(f"{str(path)!r} is not a GGUF file (no GGUF magic)")
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, KeyError, IndexError, OverflowError, EOFError, OSError) as exc:
        # A cut-short file shows up as numpy failing to map past its end, or a bad enum.
        raise TierguardError(f"{str(path)!r} is not a readable GGUF file (truncated or damaged): {exc}") from None
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > path.stat().st_size:
        raise TierguardError(f"{str(path)!r} is truncated: tensor data ends past the end of the file")
    return reader


def field(reader, key: str, default: Any = None) -> Any:
    """A metadata value (str, number, bool or list), or `default` when absent."""
    f = reader.get_field(key)
    if f is None:
        return default
    return f.contents()


def architecture(reader) -> str:
    arch = field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise TierguardError("GGUF file has no general.architecture")
    if arch not in ARCHITECTURES:
        raise TierguardError(
            f"unsupported GGUF architecture {arch!r}; tierguard runs {', '.join(sorted(ARCHITECTURES))}"
        )
    return arch


def hf_config(reader, torch_dtype: str = "float32") -> dict:
    """config.json for the model in `reader` (Llama-family keys, HF names)."""
    arch = architecture(reader)
    hf_arch, model_type, _ = ARCHITECTURES[arch]

    def need(key: str) -> Any:
        value = field(reader, f"{arch}.{key}")
        if value is None:
            raise TierguardError(f"GGUF file lacks {arch}.{key}")
        return value

    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise TierguardError(
            "GGUF file carries rope_freqs (Llama 3.1-style RoPE scaling), which import-gguf cannot map back yet"
        )
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    tokens = field(reader, "tokenizer.ggml.tokens") or []
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise TierguardError("GGUF file has no token_embd.weight tensor")
    vocab = int(field(reader, f"{arch}.vocab_size") or embd.shape[-1] or len(tokens))
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(field(reader, f"{arch}.attention.head_count_kv") or heads),
        "head_dim": int(field(reader, f"{arch}.attention.key_length") or hidden // heads),
        "hidden_act": "silu",
        "max_position_embeddings": int(field(reader, f"{arch}.context_length") or 2048),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(field(reader, f"{arch}.rope.freq_base") or 10000.0),
        "rope_scaling": _rope_scaling(reader, arch),
        "attention_bias": "blk.0.attn_q.bias" in names and arch == "llama",
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": torch_dtype,
    }
    for key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = field(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            config[hf_key] = int(value)
    if arch == "qwen2":
        config["use_sliding_window"] = False
    if arch == "gemma3":
        config.update(_gemma3_config(reader, config, tokens))
    return config


def _gemma3_config(reader, config: dict, tokens: list) -> dict:
    """Gemma 3's own keys, as transformers' Gemma3TextConfig names them. The file stores the
    window; the layer pattern and the local RoPE base are llama.cpp's fixed values; the
    query scalar is head_dim except on the 27B (62 layers), where llama.cpp uses
    hidden / heads, as the original checkpoints do."""
    layers, window = config["num_hidden_layers"], field(reader, "gemma3.attention.sliding_window")
    types = [
        "full_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else "sliding_attention" for i in range(layers)
    ]
    scalar = config["hidden_size"] // config["num_attention_heads"] if layers == 62 else config["head_dim"]
    full_rope = {"rope_type": "default", "rope_theta": config["rope_theta"]}
    if config.get("rope_scaling"):
        full_rope.update(config["rope_scaling"])
    out = {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": types,
        "sliding_window": int(window) if window else None,
        "query_pre_attn_scalar": scalar,
        "rope_local_base_freq": GEMMA3_LOCAL_ROPE_BASE,
        "rope_parameters": {
            "full_attention": full_rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_BASE},
        },
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "attention_bias": False,
    }
    pad = field(reader, "tokenizer.ggml.padding_token_id")
    if pad is not None:
        out["pad_token_id"] = int(pad)
    # The instruction-tuned model ends its turns with <end_of_turn>: a stop token beside <eos>.
    if "<end_of_turn>" in tokens and "eos_token_id" in config:
        out["eos_token_id"] = [config["eos_token_id"], tokens.index("<end_of_turn>")]
    return out


def _rope_scaling(reader, arch: str) -> dict | None:
    kind = field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise TierguardError(f"GGUF RoPE scaling type {kind!r} is not supported")
    out: dict[str, Any] = {"rope_type": kind, "factor": float(field(reader, f"{arch}.rope.scaling.factor") or 1.0)}
    original = field(reader, f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        out["original_max_position_embeddings"] = int(original)
    return out


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF name of a GGUF tensor; None for tensors a HF checkpoint does not store."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    layer = _LAYER_NAMES.get(arch, _LAYER)
    parts = gguf_name.split(".", 2)  # blk, N, rest
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer:
        return f"model.layers.{int(parts[1])}.{layer[parts[2]]}"
    return None


def norm_shift(config: dict) -> float:
    """What llama.cpp added to every RMSNorm weight when it wrote the file: Gemma's norms
    scale by (1 + w), and its converter stores 1 + w; HF checkpoints store w."""
    return 1.0 if config.get("model_type") == "gemma3_text" else 0.0


def unpermute_qk(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of `gguf_export.permute_for_gguf`: rows 2j, 2j+1 of each head go back to j
    and j + head_dim/2 (works for 1-D biases too)."""
    rows = weight.shape[0]
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def tensor_type_name(tensor) -> str:
    return tensor.tensor_type.name


def can_dequantize(qtype) -> bool:
    """Whether the installed `gguf` package dequantizes this tensor type (one zero block)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros(size, dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def plan_tensors(reader) -> list[tuple[str, Any]]:
    """(hf name, GGUF tensor) for every tensor to import, checked before anything is
    written: unknown names and types `gguf` cannot dequantize are refused by name."""
    out = []
    checked: dict[Any, bool] = {}
    arch = architecture(reader)
    for t in reader.tensors:
        if t.name in _IGNORED:
            continue
        name = hf_tensor_name(t.name, arch)
        if name is None:
            raise TierguardError(f"GGUF tensor {t.name!r} has no place in a Llama-family model")
        if t.tensor_type not in checked:
            checked[t.tensor_type] = can_dequantize(t.tensor_type)
        if not checked[t.tensor_type]:
            raise TierguardError(
                f"GGUF tensor {t.name!r} has type {t.tensor_type.name}, which the installed gguf package "
                "cannot dequantize"
            )
        out.append((name, t))
    return out


def hf_shape(tensor) -> tuple[int, ...]:
    """GGUF lists dims innermost first; HF (row-major) the other way round."""
    return tuple(int(d) for d in reversed([int(x) for x in tensor.shape]))


def dequantize(tensor, config: dict, permuted: bool) -> np.ndarray:
    """One tensor as float32 in HF layout (q/k rows back in HF order when `permuted`)."""
    import gguf

    array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    array = np.asarray(array, dtype=np.float32).reshape(hf_shape(tensor))
    shift = norm_shift(config)
    if shift and tensor.name.endswith("norm.weight"):
        array = array - np.float32(shift)
    if permuted:
        if tensor.name.endswith(("attn_q.weight", "attn_q.bias")):
            array = unpermute_qk(array, config["num_attention_heads"])
        elif tensor.name.endswith(("attn_k.weight", "attn_k.bias")):
            array = unpermute_qk(array, config["num_key_value_heads"])
    return array


def iter_hf_tensors(reader, config: dict) -> Iterator[tuple[str, np.ndarray]]:
    """(hf name, float32 array) per tensor, in file order, one at a time."""
    permuted = ARCHITECTURES[architecture(reader)][2]
    for name, tensor in plan_tensors(reader):
        yield name, dequantize(tensor, config, permuted)
