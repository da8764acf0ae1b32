"""Models behind one API (`CausalLM`): the real SmolLM2-135M (GGUF), `synthetic-m3` and `tiny-llama` (seeded random)."""

from kvtool.models.base import (
    CausalLM,
    ModelConfig,
    available_models,
    dense_causal_attention,
    dense_forward,
    greedy_generate,
    load_model,
)
from kvtool.models.corpus import default_corpus, read_prompt, tokenize

__all__ = ["CausalLM", "ModelConfig", "available_models", "default_corpus", "dense_causal_attention", "dense_forward",
           "greedy_generate", "load_model", "read_prompt", "tokenize"]
