"""Checkpoints: safetensors IO, the loader (names counted both ways), shards, tokenizer, the
embedded default model."""
