"""The prefix index service: which KV-cache blocks each engine holds, in Redis, over gRPC."""
