"""Prefect flows and deployments of ganpipe; they run DVC in subprocesses, never torch."""
