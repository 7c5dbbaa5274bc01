"""Launchers: a throwaway Redis, the index as a subprocess, health checks."""
