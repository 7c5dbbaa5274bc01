"""The prefix index gRPC server: Redis store with its Lua scripts, servicer, validation,
health, metrics and the lease sweeper."""
