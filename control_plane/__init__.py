"""Control plane: tokenizer, scheduler, KV block allocation, detokenization. Pure Python, no torch."""
