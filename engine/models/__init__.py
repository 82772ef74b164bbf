"""Model path: GGUF files -> config, weights, tokenizer, decoder."""
