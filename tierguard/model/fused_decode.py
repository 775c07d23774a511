"""A decode-only step of the whole layer stack in one C call (kernels/decode_step.c).

Why: on the CPU a batch-1 step of a small model is dominated by per-op overhead, not by
arithmetic. In eager torch a step is hundreds of ops (every layer's norm, matmuls, rope,
attention, residual...), and their dispatch, allocations and OpenMP fork/joins cost
about as much as reading the weights once. `tg_decode_step` runs all layers in one OpenMP region with the same per-op kernels and
five barriers per layer (each thread repeats the small row-wise ops on its own copy of
the rows rather than wait at two more), so the step costs about the weight reads.

What it covers: a step of up to MAX_BATCH rows (decodes, and the tokens of prefill
chunks: model_runner builds their rows), float32 activations on the CPU, a float32 KV
pool (the per-op decode kernel's pool), weights that are float32 `Linear`, `Int8Linear`,
`Int4Linear` or `Bf16Linear`, RMSNorm, no q/k norm (Qwen3 keeps the
per-op path), biases allowed (Qwen2). Anything else, or a model whose layers stream in
through hooks (weight offload), takes the per-op path; `build` logs why. Setting
`TIERGUARD_FUSED_DECODE=0` turns it off (to compare, or to rule it out).

The C side keeps raw pointers to the weights: the decoder holds references to every
tensor it points at, and is rebuilt when the model's weights change identity.
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch

from tierguard.model import native
from tierguard.model.qlinear import Bf16Linear, Int4Linear, Int8Linear

log = logging.getLogger(__name__)

MAX_BATCH = 2048  # TG_MAX_STEP_ROWS: decodes and prefill tokens of one step
KIND_F32, KIND_INT8, KIND_INT4, KIND_BF16 = 0, 1, 2, 3


class Lin(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int32),
        ("group", ctypes.c_int32),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("w", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("lo", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
    ]


class LayerW(ctypes.Structure):
    _fields_ = [("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p)] + [
        (name, Lin) for name in ("qkv", "o", "gate_up", "down")
    ]


class ModelW(ctypes.Structure):
    _fields_ = [
        ("num_layers", ctypes.c_int32),
        ("hidden", ctypes.c_int32),
        ("inter", ctypes.c_int32),
        ("heads", ctypes.c_int32),
        ("kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("eps", ctypes.c_float),
        ("layers", ctypes.POINTER(LayerW)),
        ("final_norm", ctypes.c_void_p),
    ]


class StepArgs(ctypes.Structure):
    _fields_ = [
        ("model", ctypes.POINTER(ModelW)),
        ("batch", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
        ("layer_stride", ctypes.c_int64),
        ("blk_stride", ctypes.c_int64),
        ("v_offset", ctypes.c_int64),
        ("table_stride", ctypes.c_int64),
        ("work_stride", ctypes.c_int64),
        ("pool", ctypes.c_void_p),
        ("tables", ctypes.c_void_p),
        ("rows", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("x", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("scratch", ctypes.c_void_p),
        ("threads", ctypes.c_int64),
        ("work", ctypes.c_void_p),
        ("ordered", ctypes.c_int64),
    ]


class Unsupported(Exception):
    """Why a model cannot take the fused step (logged once; the per-op path runs)."""


def _f32(t: torch.Tensor | None, what: str) -> int | None:
    if t is None:
        return None
    if t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous():
        raise Unsupported(f"{what} is not a contiguous float32 CPU tensor")
    return t.data_ptr()


def _lin(module: torch.nn.Module, what: str) -> Lin:
    bias = getattr(module, "bias", None)
    if isinstance(module, Bf16Linear):
        lin = Lin(KIND_BF16, 0, module.out_features, module.in_features, module.packed.data_ptr())
    elif isinstance(module, Int8Linear):
        lin = Lin(KIND_INT8, 0, module.out_features, module.in_features, module.qweight.data_ptr(), module.scale.data_ptr())
    elif isinstance(module, Int4Linear):
        if module.group % 16 or module.in_features % module.group:
            raise Unsupported(f"{what}: int4 group {module.group}")
        lin = Lin(
            KIND_INT4,
            module.group,
            module.out_features,
            module.in_features,
            module.qweight.data_ptr(),
            module.scale.data_ptr(),
            module.lo.data_ptr(),
        )
    elif isinstance(module, torch.nn.Linear):
        lin = Lin(KIND_F32, 0, module.out_features, module.in_features, _f32(module.weight, f"{what}.weight"))
    else:
        raise Unsupported(f"{what} is a {type(module).__name__}")
    lin.bias = _f32(bias, f"{what}.bias")
    return lin


def _norm(module: torch.nn.Module, what: str) -> int:
    if type(module).__name__ != "RMSNorm":
        raise Unsupported(f"{what} is a {type(module).__name__}")
    return _f32(module.weight, f"{what}.weight")


class FusedDecoder:
    """The model's weights as the C step sees them, plus reusable step buffers."""

    def __init__(self, model: torch.nn.Module) -> None:
        """Raises Unsupported naming the first part the C step does not cover."""
        cfg = model.config
        if os.environ.get("TIERGUARD_FUSED_DECODE", "1") == "0":
            raise Unsupported("TIERGUARD_FUSED_DECODE=0")
        if not native.available():
            raise Unsupported("no CPU kernels (no compiler or TIERGUARD_NATIVE=0)")
        if model.weight_offloader is not None:
            raise Unsupported("decoder layers stream in through hooks (weight offload)")
        if cfg.qk_norm:
            raise Unsupported("q/k norm (Qwen3)")
        if (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim != model.layers[0].self_attn.qkv_proj.out_features:
            raise Unsupported("fused q/k/v projection has an unexpected width")
        self._layers = (LayerW * cfg.num_layers)()
        for i, layer in enumerate(model.layers):
            w = self._layers[i]
            w.in_norm = _norm(layer.input_layernorm, f"layers.{i}.input_layernorm")
            w.post_norm = _norm(layer.post_attention_layernorm, f"layers.{i}.post_attention_layernorm")
            attn, mlp = layer.self_attn, layer.mlp
            for name, module in (("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate_up", mlp.gate_up_proj), ("down", mlp.down_proj)):
                setattr(w, name, _lin(module, f"layers.{i}.{name}"))
        self._model = ModelW(
            cfg.num_layers,
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.rms_norm_eps,
            ctypes.cast(self._layers, ctypes.POINTER(LayerW)),
            _norm(model.norm, "norm"),
        )
        self._fn = native.library().tg_decode_step
        self._scratch_floats = native.library().tg_decode_step_scratch
        self._scratch: torch.Tensor = torch.empty(0)
        self.hidden = cfg.hidden_size
        self.steps = 0  # steps computed here (tests and the speed probe read it)
        self._watch(model)

    def _watch(self, model: torch.nn.Module) -> None:
        """What `stale` compares: every module edge below the model and every tensor with
        its address, recorded once (walking the module tree every step would cost a visible
        share of a small model's step). The tensors are held, so what the C side points at
        stays allocated."""
        self._edges = [(parent, name, child) for parent in model.modules() for name, child in parent._modules.items()]
        self._tensors = [
            (module, name, t, t.data_ptr())
            for module in model.modules()
            for name, t in (*module._parameters.items(), *module._buffers.items())
            if t is not None
        ]
        self.submodules = [m for m in model.modules() if m is not model]

    def stale(self) -> bool:
        """True when a module or weight of the model was replaced or moved since the
        build: the C side would read the old, maybe freed, memory."""
        for parent, name, child in self._edges:
            if parent._modules.get(name) is not child:
                return True
        for module, name, _held, ptr in self._tensors:
            t = module._parameters.get(name)
            if t is None:
                t = module._buffers.get(name)
            if t is None or t.data_ptr() != ptr:
                return True
        return False

    def run(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        call: native.DecodeCall,
        ordered: bool = False,
    ) -> torch.Tensor | None:
        """x: [B, hidden] embeddings (clobbered); rope: cos / signed sin [B, 1, D];
        kv_cache: [N, layers, 2, bs, KV, D]; call: the step's DecodeCall (block tables,
        rows, context lengths, score buffer), one row per token. `ordered`: some rows are
        tokens of one prefill chunk (each row's context ends at its own position), so all
        K/V are written before any row attends. Returns final-normed hidden states, or
        None when the C step refused the shape."""
        b = x.shape[0]
        if b > MAX_BATCH:
            return None
        # torch's intra-op thread count, passed explicitly: the calling thread's own
        # OpenMP default may differ (the server's engine thread is not torch's main thread)
        threads = torch.get_num_threads()
        need = self._scratch_floats(ctypes.byref(self._model), b, threads)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32)
        x = x.contiguous()
        cos, sin = rope[0].contiguous(), rope[1].contiguous()
        out = torch.empty(b, self.hidden, dtype=torch.float32)
        d = call.args
        args = StepArgs(
            ctypes.pointer(self._model),
            b,
            d.block_size,
            kv_cache.stride(1),
            kv_cache.stride(0),
            kv_cache.stride(2),
            d.table_stride,
            d.work_stride,
            kv_cache.data_ptr(),
            d.tables,
            d.rows,
            d.ctx,
            cos.data_ptr(),
            sin.data_ptr(),
            x.data_ptr(),
            out.data_ptr(),
            self._scratch.data_ptr(),
            threads,
            d.work,
            int(ordered),
        )
        if self._fn(ctypes.byref(args)) != 0:
            return None
        self.steps += 1
        return out


def build(model: torch.nn.Module) -> FusedDecoder | None:
    """The fused decoder for this model, or None (logged once with the reason)."""
    try:
        return FusedDecoder(model)
    except Unsupported as exc:
        log.info("fused CPU decode step not used: %s", exc)
        return None
