"""What a client of the prefix index imports (the engine, the router): ops, wire
conversion, the async gRPC client."""
