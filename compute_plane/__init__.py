"""Compute plane: weights, KV-cache memory, batched forward and sampling, served over gRPC."""
