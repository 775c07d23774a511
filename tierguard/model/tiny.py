"""Random-weight tiny models: the default model for demos and tests (no hub needed).

`create_tiny` writes a normal Hugging Face directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, generation_config.json) that transformers loads
too. The tokenizer is a byte-level BPE trained here on a generated ASCII corpus, so any
text round-trips. Everything is a function of the arguments and the seed.

`arch="gemma3"` writes a Gemma 3 shape: sandwich norms stored as w (scaled by 1 + w),
q/k norms, tied embeddings, and every `sliding_pattern`-th layer full attention, the
others sliding over `sliding_window` tokens (small, so short tests cross it).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

from tierguard.common.errors import TierguardError

BOS, EOS, IM_START, IM_END = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{% for m in messages %}" + IM_START + "{{ m['role'] }}\n{{ m['content'] }}" + IM_END + "\n{% endfor %}"
    "{% if add_generation_prompt %}" + IM_START + "assistant\n{% endif %}"
)
ARCHS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# Bump when the output of create_tiny changes, so cached copies are rebuilt.
TINY_FORMAT_VERSION = 2
DEFAULT_TINY = dict(
    layers=4, hidden=256, heads=8, kv_heads=2, vocab=4096, max_position_embeddings=8192, seed=0
)

_WORDS = (
    "the of and to in is that it for on with as was be by this are or from at an not have but "
    "which one all their can more has were will if its about they would there so into some what "
    "memory cache token model layer block queue latency request prefix decode prefill page host "
    "disk tier budget offload batch stream server client time fast slow first last long short"
).split()


def _corpus(seed: int, lines: int = 6000) -> list[str]:
    """Deterministic ASCII text: English-ish words, made-up syllable words, numbers, code."""
    rng = random.Random(seed)
    cons, vows = "bcdfghjklmnprstvwz", "aeiou"
    made_up = [
        "".join(rng.choice(cons) + rng.choice(vows) for _ in range(rng.randint(1, 4))) for _ in range(3000)
    ]
    punct = [".", ",", "!", "?", ";", ":"]
    out = []
    for _ in range(lines):
        words = []
        for _ in range(rng.randint(4, 18)):
            r = rng.random()
            if r < 0.55:
                w = rng.choice(_WORDS)
            elif r < 0.85:
                w = rng.choice(made_up)
            elif r < 0.95:
                w = str(rng.randint(0, 99999))
            else:
                w = rng.choice(
                    ["x = f(y)", '{"k": 1}', "a[i] += 2", "def g():", "return 0", "#include", "->"]
                )
            if rng.random() < 0.1:
                w = w.capitalize()
            words.append(w)
        out.append(" ".join(words) + rng.choice(punct))
    return out


def _train_tokenizer(vocab: int, seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def create_tiny(
    out_dir: str | Path,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 512,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    intermediate: int | None = None,
    arch: str = "llama",
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    dtype: str = "float32",
    head_dim: int | None = None,
    sliding_window: int = 32,
    sliding_pattern: int = 3,
) -> Path:
    """Write a random-weight model + tokenizer to `out_dir` and return the path."""
    import torch
    from safetensors.torch import save_file

    if arch not in ARCHS:
        raise TierguardError(f"unknown tiny arch {arch!r}: choose one of {', '.join(ARCHS)}")
    for name, value in [("layers", layers), ("hidden", hidden), ("heads", heads), ("kv-heads", kv_heads)]:
        if value <= 0:
            raise TierguardError(f"--{name} must be positive, got {value}")
    if hidden % heads or heads % kv_heads:
        raise TierguardError(
            f"--hidden ({hidden}) must divide by --heads ({heads}), and heads by --kv-heads ({kv_heads})"
        )
    head_dim = head_dim or hidden // heads  # Qwen3-style models decouple it from hidden / heads
    if head_dim % 2:
        raise TierguardError(f"head dim {head_dim} (--hidden / --heads) must be even (rotary embeddings)")
    if vocab < 256 + len(SPECIAL_TOKENS) + 16:
        raise TierguardError(
            f"--vocab must be at least {256 + len(SPECIAL_TOKENS) + 16} (byte alphabet), got {vocab}"
        )
    if max_position_embeddings < 16:
        raise TierguardError(f"--max-position-embeddings must be at least 16, got {max_position_embeddings}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    inter = intermediate or max(64, (hidden * 8 // 3 + 63) // 64 * 64)

    tok = _train_tokenizer(vocab, seed)
    real_vocab = tok.get_vocab_size()  # BPE may stop short of the target on a small corpus
    tok.save(str(out / "tokenizer.json"))
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(IM_END)

    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    gemma = arch == "gemma3"
    tie_word_embeddings = tie_word_embeddings or gemma

    def norm(dim: int) -> torch.Tensor:  # near 1, but not exactly, so a skipped norm shows in tests
        return (0.0 if gemma else 1.0) + rand(dim, std=0.1)  # Gemma scales by (1 + w)

    std = hidden**-0.5
    # Gemma multiplies the embedding by sqrt(hidden): rows of norm ~1 keep activations at 1.
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rand(real_vocab, hidden, std=std if gemma else 1.0)}
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rand(heads * head_dim, hidden, std=std)
        w[p + "self_attn.k_proj.weight"] = rand(kv_heads * head_dim, hidden, std=std)
        w[p + "self_attn.v_proj.weight"] = rand(kv_heads * head_dim, hidden, std=std)
        w[p + "self_attn.o_proj.weight"] = rand(hidden, heads * head_dim, std=std)
        if arch == "qwen2":
            w[p + "self_attn.q_proj.bias"] = rand(heads * head_dim, std=0.1)
            w[p + "self_attn.k_proj.bias"] = rand(kv_heads * head_dim, std=0.1)
            w[p + "self_attn.v_proj.bias"] = rand(kv_heads * head_dim, std=0.1)
        if arch in ("qwen3", "gemma3"):
            w[p + "self_attn.q_norm.weight"] = norm(head_dim)
            w[p + "self_attn.k_norm.weight"] = norm(head_dim)
        if gemma:
            w[p + "pre_feedforward_layernorm.weight"] = norm(hidden)
            w[p + "post_feedforward_layernorm.weight"] = norm(hidden)
        w[p + "mlp.gate_proj.weight"] = rand(inter, hidden, std=std)
        w[p + "mlp.up_proj.weight"] = rand(inter, hidden, std=std)
        w[p + "mlp.down_proj.weight"] = rand(hidden, inter, std=inter**-0.5)
        w[p + "input_layernorm.weight"] = norm(hidden)
        w[p + "post_attention_layernorm.weight"] = norm(hidden)
    w["model.norm.weight"] = norm(hidden)
    if not tie_word_embeddings:
        head = rand(real_vocab, hidden, std=std)
        # Zero the rows of tokens that would print badly (control tokens other than EOS,
        # partial UTF-8 bytes): their logit is then 0, below the maximum of the others, so
        # greedy demos print clean ASCII. The model stays a plain Llama.
        head[_unprintable_ids(tok, keep={eos_id})] = 0.0
        w["lm_head.weight"] = head
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    save_file(
        {k: v.to(torch_dtype).contiguous() for k, v in w.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )

    config = {
        "architectures": [ARCHS[arch]],
        "model_type": arch,
        "vocab_size": real_vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "attention_bias": False,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": dtype,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }
    if arch == "qwen2":
        config["use_sliding_window"] = False
    if arch == "mistral":
        config["sliding_window"] = None
    if gemma:
        config.update(_gemma3_config(layers, head_dim, rope_theta, sliding_window, sliding_pattern))
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eos_id})
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": IM_END,
            "pad_token": EOS,
            "model_max_length": max_position_embeddings,
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
        },
    )
    return out


def _gemma3_config(layers: int, head_dim: int, rope_theta: float, window: int, pattern: int) -> dict:
    if window < 1 or pattern < 1:
        raise TierguardError(f"gemma3: sliding window ({window}) and pattern ({pattern}) must be positive")
    types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    if "full_attention" not in types:
        raise TierguardError(f"gemma3: {layers} layers with pattern {pattern} leave no full-attention layer")
    local = 10000.0
    return {
        "model_type": "gemma3_text",
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": types,
        "sliding_window": window,
        "query_pre_attn_scalar": head_dim,
        "rope_theta": rope_theta,
        "rope_local_base_freq": local,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": local},
        },
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "tie_word_embeddings": True,
    }


def _unprintable_ids(tok, keep: set[int]) -> list[int]:
    out = []
    for i in range(tok.get_vocab_size()):
        text = tok.decode([i], skip_special_tokens=False)
        if i not in keep and (
            text in SPECIAL_TOKENS or not (text.isascii() and text.isprintable() or text == "\n")
        ):
            out.append(i)
    return out


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def cache_root() -> Path:
    env = os.environ.get("TIERGUARD_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "tierguard"


def ensure_tiny_model(cache_dir: str | Path | None = None, **overrides) -> Path:
    """Build the default tiny model once into the cache and reuse it.

    Safe against concurrent builders: each builds in its own temp dir and renames it into
    place; the loser of the race discards its copy.
    """
    params = {**DEFAULT_TINY, **overrides}
    root = Path(cache_dir) if cache_dir else cache_root()
    tag = "-".join(f"{k}{v}" for k, v in sorted(params.items()) if v is not None)
    final = root / "models" / f"tiny-v{TINY_FORMAT_VERSION}-{tag.replace('/', '_')}"
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=final.parent))
    try:
        create_tiny(tmp, **params)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
