"""API keys and tenants at the front doors (the router, an engine served alone).

A key belongs to a tenant (keys.py); the tenant, not the client, decides the cache salt
(salt.py); every call is authenticated in one place for gRPC and HTTP alike (gate.py), and
per-tenant limits are counted where the key is checked (ledger.py, door.py)."""
