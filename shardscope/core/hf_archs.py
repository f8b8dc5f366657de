"""Built-in Hugging Face architecture values (torch-free), from each model's public config.json.

The engines build a ``transformers`` config from these, with ``num_hidden_layers`` replaced by
the preset's ``model.hf_layers``. Nothing is ever downloaded.
"""

ARCHS: dict[str, dict] = {
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    },
    # The Qwen2 module layout shrunk for CPU tests and presets: same blocks (q/k/v with bias, GQA
    # with 2 query heads per key/value head, SwiGLU MLP, RMSNorm, RoPE, tied embeddings), a
    # 512-token vocabulary instead of 151936. Not a published model.
    "qwen2-tiny": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    },
}
