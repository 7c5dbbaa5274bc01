"""Generated gRPC stubs for protos/ (regenerate with `python scripts/gen_protos.py`)."""
