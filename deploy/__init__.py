"""Deployment assets (Envoy, containers, Kubernetes, monitoring) and their helpers."""
