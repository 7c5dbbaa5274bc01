"""Our Llama-family forward over the paged KV cache."""
