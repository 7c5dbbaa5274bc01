"""The gRPC generation server: server and servicer, the async front that owns the engine
thread, the error-to-status mapping and Prometheus metrics."""
