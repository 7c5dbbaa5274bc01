"""The OpenAI-compatible HTTP API, shared by the engine and the router.

Each front mounts the same Starlette app (app.py) on uvicorn in its own event loop (server.py),
given a Backend (backend.py) that calls its existing gRPC servicer: the OpenAI JSON is mapped
onto a GenerateRequest (to_engine.py), validated and run by the same code as a gRPC call, and
the servicer's messages are mapped back to OpenAI's shapes (from_engine.py).
"""
