"""Constant per-sequence state of Mamba and linear-attention layers.

These layers keep a convolution window and a recurrent state whose size does not
depend on context length; counting them as attention is a known calculator bug.
Returned as element counts (conv, recurrent) for one sequence, one layer, TP=1.
"""

from __future__ import annotations

from tierguard.common.errors import TierguardError


def _get(cfg: dict, name: str, *keys: str, default: int | None = None) -> int:
    for key in keys:
        if cfg.get(key) is not None:
            return int(cfg[key])
    if default is not None:
        return default
    raise TierguardError(f"model config {name!r} has {keys[0].split('_')[0]} layers but lacks {keys[0]!r}")


def constant_state_elems(cfg: dict, name: str, kind: str, hidden: int) -> tuple[int, int]:
    """(conv elements, recurrent elements) per sequence per layer."""
    if kind == "linear":
        # Gated DeltaNet (Qwen3-Next) style: conv over q, k, v; state heads x dk x dv.
        nk = _get(cfg, name, "linear_num_key_heads")
        dk = _get(cfg, name, "linear_key_head_dim")
        nv = _get(cfg, name, "linear_num_value_heads")
        dv = _get(cfg, name, "linear_value_head_dim")
        kernel = _get(cfg, name, "linear_conv_kernel_dim", default=4)
        return (kernel - 1) * (2 * nk * dk + nv * dv), nv * dk * dv
    d_state = _get(cfg, name, "mamba_d_state", "ssm_state_size", "state_size")
    d_conv = _get(cfg, name, "mamba_d_conv", "conv_kernel", default=4)
    if cfg.get("mamba_num_heads") is not None:
        # Mamba2: heads x head_dim x d_state; conv over x, B, C.
        n_heads = _get(cfg, name, "mamba_num_heads")
        head_dim = _get(cfg, name, "mamba_head_dim")
        groups = _get(cfg, name, "mamba_n_groups", "n_groups", default=1)
        inner = n_heads * head_dim
        return (d_conv - 1) * (inner + 2 * groups * d_state), n_heads * head_dim * d_state
    # Mamba1 (Jamba): inner = expand x hidden.
    inner = _get(cfg, name, "mamba_expand", "expand", default=2) * hidden
    return (d_conv - 1) * inner, inner * d_state
