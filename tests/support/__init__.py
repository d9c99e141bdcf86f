"""Helpers shared by the unit and integration tests (no fixtures here)."""
