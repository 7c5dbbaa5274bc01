"""Tensor parallelism on torch.distributed: one engine over several ranks (NCCL on CUDA, gloo
on the CPU). Rank 0 is the engine (scheduler, KV cache manager, sampling); the other ranks are
worker processes that run the same forward on their shards (worker.py), driven by one
broadcast per step (channel.py)."""
