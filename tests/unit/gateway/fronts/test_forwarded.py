"""Whose x-forwarded-for counts, with the peers gRPC and aiohttp report."""

from __future__ import annotations

import pytest

from gateway.fronts.forwarded import TrustedProxies

XFF = "203.0.113.1, 198.51.100.9"


@pytest.mark.parametrize(
    ("proxies", "peer", "source"),
    [
        ((), "ipv4:127.0.0.1:5000", "127.0.0.1"),  # trust no one: the peer
        (("127.0.0.1",), "ipv4:127.0.0.1:5000", "198.51.100.9"),  # the proxy's last hop
        (("127.0.0.1",), "ipv4:10.1.2.3:5000", "10.1.2.3"),  # not the proxy
        (("10.0.0.0/8",), "10.1.2.3", "198.51.100.9"),  # aiohttp's plain address
        (("::1",), "ipv6:[::1]:5000", "198.51.100.9"),
        (("127.0.0.1",), "ipv6:[::ffff:127.0.0.1]:5000", "198.51.100.9"),  # v4-mapped
        (("127.0.0.1",), "unix:/tmp/sock", "unix:/tmp/sock"),  # no address: never a proxy
    ],
)
def test_forwarded_for_counts_only_from_a_proxy(
    proxies: tuple[str, ...], peer: str, source: str
) -> None:
    assert TrustedProxies(proxies).source(XFF, peer) == source


def test_a_proxy_from_a_proxy_without_the_header_is_the_peer() -> None:
    assert TrustedProxies(["127.0.0.1"]).source("", "ipv4:127.0.0.1:1") == "127.0.0.1"


def test_an_entry_that_is_no_address_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'envoy'"):
        TrustedProxies(["10.0.0.0/8", "envoy"])
