"""Models: loading, LoRA, special tokens, PrefixLM attention masks."""
