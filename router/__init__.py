"""The KV-aware router: one pagedgen.generation.v1.Generation address in front of many engine
replicas, each request sent where its prompt's prefix is already cached unless that replica is
overloaded (see DESIGN.md, Router)."""
