"""The engine core: step loop, scheduler, KV cache manager, block pool, block hashes,
sequences.

The whole data path of a request's KV blocks lives here; the model runner (engine_service.model)
sees only the plain data types of a scheduled step."""
