"""Llama-family and Gemma 3 models in plain PyTorch, loaded from local Hugging Face directories.

config.py     ModelConfig from config.json
layers.py     RMSNorm, rotary embeddings (incl. Llama 3 scaling), SwiGLU
attention.py  attention over the paged KV cache, model dtype or fp8/int8 + scales (layout there)
llama.py      the decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3)
gemma3.py     Gemma 3: sandwich norms, (1 + w) RMSNorm, GeGLU, local/global RoPE, sliding windows
loader.py     safetensors (incl. sharded) -> model on a device/dtype
tokenizer.py  `tokenizers`-based tokenizer with a jinja2 chat template
tiny.py       random-weight tiny models + a locally trained BPE tokenizer
native.py     builds and loads the C kernels (kernels/: attention, GEMV, tiles, row ops, fused step)
"""
