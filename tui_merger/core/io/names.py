"""Tensor names that several stages recognise (the plan, quantization, kohya mapping, verification)."""

INPUT_EMBEDDING_SUFFIXES = (
    "embed_tokens.weight",
    "wte.weight",
    "word_embeddings.weight",
    "tok_embeddings.weight",
    "embed_in.weight",
)
OUTPUT_EMBEDDING = "lm_head.weight"
