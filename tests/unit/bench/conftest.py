"""Fixtures of the bench tests (tests/unit/bench/fakes.py)."""

from tests.unit.bench.fakes import fake_results, fake_sides

__all__ = ["fake_results", "fake_sides"]
