"""Redis node addresses: ``host:port``, IPv6 in brackets, and what is refused."""

from __future__ import annotations

import pytest

from common.redis_nodes import parse_node


def test_parse_node() -> None:
    assert parse_node(" redis-0.redis:6379 ") == ("redis-0.redis", 6379)
    assert parse_node("[::1]:7000") == ("::1", 7000)


@pytest.mark.parametrize("bad", ["10.0.0.2", ":7001", "h:0", "h:70000", "h:port", "[]:7000"])
def test_a_bad_node_is_named(bad: str) -> None:
    with pytest.raises(ValueError, match="host:port"):
        parse_node(bad)
