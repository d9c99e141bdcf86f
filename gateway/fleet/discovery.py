"""Engine replicas behind a DNS name: every address is a replica, re-resolved periodically.

``[gateway] engines`` lists ``[protocol://]host:port`` entries
(``gateway.config.EngineEntry``); each address of an entry keeps its protocol and
options, and remembers the name it came from (engine certificates are checked
against it). An IP literal is one replica. A name (for example a Kubernetes
headless Service, ``engine:50071``) stands for every address it resolves to, so the
gateway balances over the pods itself (health, load, KV usage, breakers) instead of
gRPC's pick-first sending everything to one of them. Names are resolved again every
``discovery_interval_s``: new pods join the pool, vanished ones are taken out
of routing at once and closed after ``grace_s`` (their streams finish or fail
over first). IPv4 addresses are preferred when a name has both families, so
``localhost`` stays one replica.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Sequence

from common.log import get_logger
from common.tasks import cancel_and_wait
from gateway.config import EngineEntry, parse_engine_entry

log = get_logger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]


def split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def resolve(host: str, port: int) -> list[str]:
    """Every address of ``host`` as ``ip:port`` (IPv4 if it has any), sorted."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    v4 = sorted({str(i[4][0]) for i in infos if i[0] == socket.AF_INET})
    v6 = sorted({str(i[4][0]) for i in infos if i[0] == socket.AF_INET6})
    return [f"{ip}:{port}" for ip in v4] or [f"[{ip}]:{port}" for ip in v6]


async def expand(entries: Sequence[str], resolver: Resolver = resolve) -> list[EngineEntry]:
    """The replica addresses of ``entries``; a name that does not resolve adds none."""
    out: dict[str, EngineEntry] = {}
    for text in entries:
        entry = parse_engine_entry(text)
        if is_ip(entry.host):
            out.setdefault(str(entry), entry)
            continue
        try:
            addresses = await resolver(entry.host, entry.port)
        except OSError as e:
            log.warning("engine name does not resolve (yet)", entry=text, error=str(e))
            continue
        for address in addresses:
            one = entry.with_host(split(address)[0])
            out.setdefault(str(one), one)
    return list(out.values())


def has_names(entries: Sequence[str]) -> bool:
    """True when some entry is a DNS name (so re-resolving can change the pool)."""
    return any(not is_ip(parse_engine_entry(e).host) for e in entries)


class Discovery:
    """Re-resolves the configured entries and syncs the pool with the answer.

    Args:
        entries: ``[gateway] engines``.
        sync: applies a new address list to the pool (adds and removes replicas).
        interval_s: time between resolutions.
    """

    def __init__(
        self,
        entries: Sequence[str],
        sync: Callable[[list[EngineEntry]], None],
        interval_s: float,
        resolver: Resolver = resolve,
    ) -> None:
        self.entries = list(entries)
        self._sync = sync
        self._interval = interval_s
        self._resolver = resolver
        self._task: asyncio.Task[None] | None = None

    async def refresh(self) -> list[EngineEntry]:
        """Resolve once and sync; an empty answer keeps the current pool (DNS hiccup)."""
        addresses = await expand(self.entries, self._resolver)
        if addresses:
            self._sync(addresses)
        return addresses

    def start(self) -> None:
        if has_names(self.entries) and self._task is None:
            self._task = asyncio.create_task(self._loop(), name="engine-discovery")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.refresh()
            except Exception:
                log.exception("engine discovery failed; keeping the current replicas")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
