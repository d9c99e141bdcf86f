"""Redis node addresses as the configuration and the cluster tools write them."""

from __future__ import annotations


def parse_node(text: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) -> (host, port), or ValueError."""
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"a Redis node must be host:port, got {text!r}")
    return host, int(port)
