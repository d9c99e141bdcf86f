"""common.server.run: the services' event loop (uvloop where installed, else asyncio)."""

from __future__ import annotations

import asyncio

import pytest

from common import server


def _loop_module() -> str:
    seen: list[str] = []

    async def main() -> None:
        seen.append(type(asyncio.get_running_loop()).__module__)

    server.run(main())
    return seen[0]


def test_services_run_on_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    """uvloop is a dependency on this platform: its absence is a failure, not a skip."""
    monkeypatch.delenv(server.EVENT_LOOP_ENV, raising=False)
    assert server.event_loop_kind() == "uvloop"
    assert _loop_module().startswith("uvloop")


def test_the_environment_can_ask_for_plain_asyncio(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(server.EVENT_LOOP_ENV, "asyncio")
    assert server.event_loop_kind() == "asyncio"
    assert _loop_module().startswith("asyncio")
