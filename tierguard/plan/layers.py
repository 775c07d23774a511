"""Which cache each layer keeps, from the many ways configs spell it.

Precedence (first match wins), as the engines read configs:
  1. `layer_types` list (full_attention / sliding_attention / chunked_attention /
     linear_attention / mamba / ...)
  2. `hybrid_override_pattern` (Nemotron-H: M = Mamba, * = attention, - or E = no cache)
  3. `full_attention_interval` (Qwen3-Next: every N-th layer full, others linear)
  4. `attn_layer_period` / `attn_layer_offset` (Jamba: attention layers, others Mamba)
  5. MLA (`kv_lora_rank`): every layer holds one latent
  6. `attention_chunk_size` (Llama 4): RoPE layers are chunked, every 4th (NoPE) global
  7. `sliding_window` (unless null or `use_sliding_window: false`): by pattern
"""

from __future__ import annotations

from tierguard.common.errors import TierguardError

_TYPE_NAMES = {
    "full_attention": "full",
    "attention": "full",
    "global_attention": "full",
    "full": "full",
    "sliding_attention": "sliding",
    "local_attention": "sliding",
    "sliding": "sliding",
    "chunked_attention": "chunked",
    "chunked": "chunked",
    "linear_attention": "linear",
    "linear": "linear",
    "mamba": "mamba",
    "mamba2": "mamba",
    "mlp": "none",
    "moe": "none",
    "none": "none",
}
_PATTERN_CHARS = {"M": "mamba", "*": "full", "-": "none", "E": "none"}


def _window(cfg: dict, name: str) -> int | None:
    value = cfg.get("sliding_window")
    if value is None or cfg.get("use_sliding_window") is False:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TierguardError(
            f"model config {name!r}: sliding_window must be a positive integer, got {value!r}"
        )
    return value


def _sliding_pattern(cfg: dict, num_layers: int) -> list[str]:
    """Which layers slide when a config names a window but no `layer_types`."""
    arch = " ".join(cfg.get("architectures") or []).lower() + " " + str(cfg.get("model_type", "")).lower()
    pattern = cfg.get("sliding_window_pattern")
    if pattern is None and "gemma3" in arch:
        pattern = 6  # Gemma-3 default: five local layers, then one global
    if pattern is None and "cohere2" in arch:
        pattern = 4
    if isinstance(pattern, int) and pattern > 0:
        return ["full" if (i + 1) % pattern == 0 else "sliding" for i in range(num_layers)]
    if "gemma2" in arch or "gptoss" in arch.replace("-", "").replace("_", ""):
        # Alternating, starting with a sliding layer.
        return ["sliding" if i % 2 == 0 else "full" for i in range(num_layers)]
    if cfg.get("use_sliding_window") and cfg.get("max_window_layers") is not None:
        # Qwen2 family: the first max_window_layers layers keep full attention.
        first_full = int(cfg["max_window_layers"])
        return ["sliding" if i >= first_full else "full" for i in range(num_layers)]
    return ["sliding"] * num_layers  # Mistral v0.1, Phi-3: every layer slides


def resolve_layer_kinds(
    cfg: dict, name: str, num_layers: int, is_mla: bool
) -> tuple[list[str], int | None, int | None]:
    """Return (kind per layer, sliding window or None, chunk size or None)."""
    window = _window(cfg, name)
    chunk = cfg.get("attention_chunk_size") or None
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise TierguardError(f"model config {name!r}: layer_types must be a list of {num_layers} entries")
        kinds = []
        for t in types:
            kind = _TYPE_NAMES.get(str(t).lower())
            if kind is None:
                raise TierguardError(f"model config {name!r}: unknown layer type {t!r} in layer_types")
            kinds.append(kind)
        if is_mla:
            kinds = ["mla" if k == "full" else k for k in kinds]
    elif cfg.get("hybrid_override_pattern"):
        pattern = str(cfg["hybrid_override_pattern"])
        if len(pattern) != num_layers or any(c not in _PATTERN_CHARS for c in pattern):
            raise TierguardError(
                f"model config {name!r}: hybrid_override_pattern must have {num_layers} "
                f"characters from M, *, -, E"
            )
        kinds = [_PATTERN_CHARS[c] for c in pattern]
    elif cfg.get("full_attention_interval"):
        n = int(cfg["full_attention_interval"])
        kinds = ["full" if (i + 1) % n == 0 else "linear" for i in range(num_layers)]
    elif cfg.get("attn_layer_period"):
        period, offset = int(cfg["attn_layer_period"]), int(cfg.get("attn_layer_offset") or 0)
        kinds = ["full" if i % period == offset else "mamba" for i in range(num_layers)]
    elif is_mla:
        kinds = ["mla"] * num_layers
    elif chunk:
        rope = cfg.get("no_rope_layers") or [int((i + 1) % 4 != 0) for i in range(num_layers)]
        if len(rope) != num_layers:
            raise TierguardError(f"model config {name!r}: no_rope_layers must have {num_layers} entries")
        kinds = ["chunked" if r else "full" for r in rope]
    elif window is not None:
        kinds = _sliding_pattern(cfg, num_layers)
    else:
        kinds = ["full"] * num_layers
    if "sliding" in kinds and window is None:
        if cfg.get("use_sliding_window") is False or cfg.get("sliding_window") is None:
            # layer_types says sliding, but the window is off: those layers keep everything.
            kinds = ["full" if k == "sliding" else k for k in kinds]
    if "chunked" in kinds and not chunk:
        raise TierguardError(f"model config {name!r} has chunked layers but no attention_chunk_size")
    return kinds, (window if "sliding" in kinds else None), (int(chunk) if "chunked" in kinds else None)
