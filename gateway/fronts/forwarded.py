"""Whose ``x-forwarded-for`` the fronts believe: only a configured proxy's.

The failed-auth throttle counts per client address. Behind Envoy the client is
the last ``x-forwarded-for`` hop, which Envoy appends; but anyone who reaches
the gateway's ports directly can send that header too, and pick a fresh
address for every try. So the header is read only on connections from
``gateway.trusted_proxies`` (addresses or CIDR blocks: Envoy's); from anywhere
else the connection's peer is the client.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from gateway.domain import client_source

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_proxies(entries: Iterable[str]) -> tuple[Network, ...]:
    """Addresses and CIDR blocks (``10.0.0.0/8``, ``::1``).

    Raises:
        ValueError: an entry that is neither, naming it.
    """
    out = []
    for entry in entries:
        try:
            out.append(ipaddress.ip_network(entry.strip(), strict=False))
        except ValueError:
            raise ValueError(
                f"trusted proxy {entry!r} is not an IP address or CIDR block "
                "(e.g. 10.0.0.0/8 or ::1)"
            ) from None
    return tuple(out)


class TrustedProxies:
    """The client address of a call, believing ``x-forwarded-for`` only from proxies.

    Args:
        proxies: Addresses and CIDR blocks of the proxies in front (none = trust no
            one: the peer is always the client).
    """

    def __init__(self, proxies: Iterable[str] = ()) -> None:
        self.networks = parse_proxies(proxies)

    def trusts(self, address: str) -> bool:
        """Whether ``address`` (a peer without its port) is one of the proxies."""
        try:
            ip = ipaddress.ip_address(address.split("%", 1)[0])
        except ValueError:
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip in net for net in self.networks)

    def source(self, forwarded_for: str, peer: str) -> str:
        """The client's address: the last ``x-forwarded-for`` hop when ``peer`` is a
        trusted proxy, else the peer (gRPC's ``ipv4:1.2.3.4:5678`` or a plain address)."""
        address = client_source("", peer)
        if forwarded_for and self.trusts(address):
            return client_source(forwarded_for, peer)
        return address
