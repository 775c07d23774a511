"""Write a local Llama-architecture Hugging Face directory as a GGUF file.

Why: the sweep compares `tierguard serve` against other engines on the same weights.
llama.cpp only reads GGUF, and we never download models, so the tiny model has to be
converted here. `gguf` is an optional dependency, imported only when a conversion runs.

Scope: Llama / Mistral layouts without biases, q/k norms or RoPE scaling (the tiny
model and most Llama checkpoints), byte-level BPE tokenizers (`tokenizer.json`),
f32, f16, or q8_0 / q4_0 / q4_1 weights (quantized with gguf's numpy quantizers; the
benchmark against llama.cpp needs a Q8_0 file and llama.cpp's quantize tool is not
installed). Anything else is refused with a message naming what is unsupported.

Two layout facts the conversion relies on:
- HF Llama checkpoints apply RoPE on two halves of each head (rotate_half), llama.cpp's
  "llama" architecture on adjacent pairs. Re-ordering the rows of q_proj / k_proj per
  head (row i of the first half next to row i of the second) makes both compute the
  same attention; k uses the KV-head count.
- A numpy array of shape (rows, cols) is written with GGUF dims [cols, rows]; llama.cpp
  expects exactly that for every 2-D weight, so no transposes are needed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tierguard.common.errors import TierguardError
from tierguard.model.config import ModelConfig
from tierguard.model.gguf_tokenizer import pre_tokenizer_name

# HF name inside "model.layers.N." -> GGUF name inside "blk.N."
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
EXPORT_DTYPES = ("f32", "f16", "q8_0", "q4_0", "q4_1")
_FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "q8_0": "MOSTLY_Q8_0", "q4_0": "MOSTLY_Q4_0", "q4_1": "MOSTLY_Q4_1"}
_QUANT_TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1"}
# GGUF token types (gguf.TokenType): normal, control (special), user-defined (added).
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5


@dataclass
class GGUFExport:
    """What was written: enough for a caller to start a server and name the model."""

    path: Path
    tensors: int
    vocab_size: int
    dtype: str


def gguf_tensor_name(hf_name: str) -> str | None:
    """The GGUF name for an HF Llama tensor, None for tensors llama.cpp does not use."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    parts = hf_name.split(".", 3)  # model, layers, N, rest
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _LAYER_NAMES:
        return f"blk.{int(parts[2])}.{_LAYER_NAMES[parts[3]]}"
    return None


def permute_for_gguf(weight, n_heads: int):
    """Re-order rows of a q/k projection from HF's half-split RoPE to adjacent pairs.

    `weight` has n_heads * head_dim rows; within each head, row j of the first half and
    row j of the second half end up at rows 2j and 2j+1.
    """
    rows = weight.shape[0]
    half = rows // n_heads // 2
    return weight.reshape(n_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def export_gguf(model_dir: str | Path, out_path: str | Path, dtype: str = "f32") -> GGUFExport:
    """Convert `model_dir` (config.json, *.safetensors, tokenizer.json) to `out_path`."""
    try:
        import gguf
    except ImportError as exc:
        raise TierguardError("GGUF export needs the optional `gguf` package: pip install gguf") from exc
    if dtype not in EXPORT_DTYPES:
        raise TierguardError(f"GGUF dtype must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}")
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    _check_supported(cfg)
    tokens, types, merges = _read_vocab(model_dir, cfg.vocab_size)

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(model_dir.name)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(cfg.head_dim)
    if cfg.head_dim * cfg.num_heads != cfg.hidden_size:  # decoupled head_dim must be explicit
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(getattr(gguf.LlamaFileType, _FILE_TYPES[dtype]))

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer_name(_read_json(model_dir / "tokenizer.json")))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if cfg.bos_token_id is not None:
        writer.add_bos_token_id(int(cfg.bos_token_id))
        writer.add_add_bos_token(_adds_bos(model_dir, int(cfg.bos_token_id)))
    if cfg.eos_token_ids:
        writer.add_eos_token_id(cfg.eos_token_ids[0])
    tok_cfg = _read_json(model_dir / "tokenizer_config.json")
    pad = tok_cfg.get("pad_token")
    if isinstance(pad, str) and pad in tokens:
        writer.add_pad_token_id(tokens.index(pad))
    if isinstance(tok_cfg.get("chat_template"), str):
        writer.add_chat_template(tok_cfg["chat_template"])

    count = 0
    for name, array in _gguf_tensors(model_dir, cfg, dtype):
        if dtype in _QUANT_TYPES and array.ndim > 1:
            # llama.cpp's own quantize tool is not installed; gguf's numpy quantizers write
            # the same block formats (2-D weights only, norms stay f32, as llama.cpp does).
            qtype = getattr(gguf.GGMLQuantizationType, _QUANT_TYPES[dtype])
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)
        count += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFExport(path=out, tensors=count, vocab_size=cfg.vocab_size, dtype=dtype)


def _check_supported(cfg: ModelConfig) -> None:
    if cfg.architecture not in ("LlamaForCausalLM", "MistralForCausalLM"):
        raise TierguardError(f"GGUF export supports Llama/Mistral layouts only, not {cfg.architecture}")
    unsupported = [
        name
        for name, present in [
            ("attention biases", cfg.qkv_bias or cfg.o_bias),
            ("q/k norms", cfg.qk_norm),
            ("rope_scaling", cfg.rope_scaling is not None),
        ]
        if present
    ]
    if unsupported:
        raise TierguardError(f"GGUF export does not handle {', '.join(unsupported)} yet")


def _gguf_tensors(model_dir: Path, cfg: ModelConfig, dtype: str):
    """Yield (gguf name, numpy array) in checkpoint order; 1-D norms always stay f32."""
    import numpy as np
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise TierguardError(f"no *.safetensors in {model_dir}")
    seen: set[str] = set()
    for file in files:
        for hf_name, tensor in load_file(str(file)).items():
            name = gguf_tensor_name(hf_name)
            # Tied embeddings: llama.cpp reuses token_embd when `output` is absent.
            if name is None or (name == "output.weight" and cfg.tie_word_embeddings):
                continue
            array = tensor.float().numpy()
            if name.endswith("attn_q.weight"):
                array = permute_for_gguf(array, cfg.num_heads)
            elif name.endswith("attn_k.weight"):
                array = permute_for_gguf(array, cfg.num_kv_heads)
            if dtype == "f16" and array.ndim > 1:
                array = array.astype(np.float16)
            seen.add(name)
            yield name, np.ascontiguousarray(array)
    missing = [n for n in ("token_embd.weight", "output_norm.weight") if n not in seen]
    if missing:
        raise TierguardError(f"{model_dir} lacks tensors for {', '.join(missing)}")


def _read_vocab(model_dir: Path, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """Tokens by id, their GGUF types and the BPE merges, from tokenizer.json."""
    raw = _read_json(model_dir / "tokenizer.json")
    model = raw.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise TierguardError(f"GGUF export needs a BPE tokenizer.json in {model_dir}")
    by_id: dict[int, str] = {int(i): t for t, i in model["vocab"].items()}
    kinds: dict[int, int] = {}
    for added in raw.get("added_tokens") or []:
        by_id[int(added["id"])] = added["content"]
        kinds[int(added["id"])] = _CONTROL if added.get("special") else _USER_DEFINED
    if max(by_id) >= vocab_size:
        raise TierguardError(
            f"tokenizer has token id {max(by_id)} but the model's vocab_size is {vocab_size}"
        )
    size = vocab_size
    tokens, types = [], []
    for i in range(size):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(kinds.get(i, _NORMAL))
        else:  # embedding rows beyond the tokenizer (padded vocab): never produced
            tokens.append(f"[PAD{i}]")
            types.append(_UNUSED)
    # tokenizers writes merges as "a b" strings (old) or [a, b] pairs (new).
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    return tokens, types, merges


def _adds_bos(model_dir: Path, bos_id: int) -> bool:
    """Whether the HF tokenizer itself prepends BOS, so llama.cpp does the same."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode("a").ids
    return bool(ids) and ids[0] == bos_id


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TierguardError(f"{path} is not valid JSON: {exc}") from exc
