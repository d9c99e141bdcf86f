"""Helpers of bench.gateway_bench."""
