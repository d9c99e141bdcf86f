"""Model routes: aliases and fallback chains chosen by replica readiness, context and
vocabulary, and the answer when nothing serves a name (a fake pool; the Redis store and
the gateway are covered end to end)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import grpc
import pytest
from prometheus_client import REGISTRY

from gateway.fleet.replica_pool import ModelEntry, ReplicaPool
from gateway.release.model_routes import ModelRoute, RouteCache, RouteStore, RouteTarget
from gateway.request.models import ModelChooser
from llm.v1 import engine_pb2


class FakePool:
    """(model, version) -> (ModelInfo, ready)."""

    def __init__(self, served: dict[tuple[str, str], tuple[int, int, bool]]) -> None:
        self.served = served  # -> (context, vocab, ready)

    def _match(self, model: str, version: str) -> list[tuple[str, str]]:
        return [k for k in self.served if k[0] == model and (not version or k[1] == version)]

    def model_info(self, model: str, version: str = "") -> engine_pb2.ModelInfo | None:
        keys = self._match(model, version)
        if not keys:
            return None
        ctx, vocab, _ = self.served[keys[0]]
        return engine_pb2.ModelInfo(
            model=model, version=keys[0][1], max_context_length=ctx, vocab_size=vocab
        )

    def candidates(self, model: str, version: str, exclude: Any) -> list[str]:
        return [f"{k}" for k in self._match(model, version) if self.served[k][2]]

    def catalog(self) -> list[ModelEntry]:
        models = sorted({m for m, _ in self.served})
        return [
            ModelEntry(m, 2048, {v: (1, 1) for mm, v in self.served if mm == m}) for m in models
        ]

    def explain(self, model: str, version: str, exclude: set[str]) -> str:
        return "no replica has answered yet"


class FakeStore:
    def __init__(self, routes: list[ModelRoute]) -> None:
        self.routes = {r.name: r for r in routes}

    async def load_all(self) -> dict[str, ModelRoute]:
        return dict(self.routes)


def chooser(pool: FakePool, *routes: ModelRoute) -> ModelChooser:
    cache = RouteCache(cast(RouteStore, FakeStore(list(routes))))
    return ModelChooser(cast(ReplicaPool, pool), cache)


def fallbacks(reason: str) -> float:
    return REGISTRY.get_sample_value("gateway_model_fallbacks_total", {"reason": reason}) or 0.0


def route(name: str, *targets: str) -> ModelRoute:
    return ModelRoute(name, tuple(RouteTarget(*t.split("@")) for t in targets))


def test_an_alias_resolves_to_its_model_and_pinned_version() -> None:
    pool = FakePool({("m", "v1"): (2048, 100, True), ("m", "v2"): (2048, 100, True)})
    c = asyncio.run(chooser(pool, route("chat", "m@v2")).choose("chat", ""))
    assert (c.model, c.version) == ("m", "v2")
    plain = asyncio.run(chooser(pool).choose("m", "v1"))
    assert (plain.model, plain.version) == ("m", "v1")
    assert not asyncio.run(chooser(pool).choose("unknown", "")).candidates


def test_a_target_without_a_ready_replica_is_passed_over() -> None:
    pool = FakePool({("big", ""): (4096, 100, False), ("small", ""): (2048, 100, True)})
    c = asyncio.run(chooser(pool, route("big", "big", "small")).choose("big", ""))
    assert c.model == "small"
    # nothing ready at all: the first target stays first (its error explains why)
    pool.served[("small", "")] = (2048, 100, False)
    c = asyncio.run(chooser(pool, route("big", "big", "small")).choose("big", ""))
    assert c.model == "big"


def test_a_target_no_replica_serves_is_a_counted_fallback() -> None:
    pool = FakePool({("small", ""): (2048, 100, True)})
    before = fallbacks("unavailable")
    c = asyncio.run(chooser(pool, route("r", "gone", "small")).choose("r", ""))
    assert c.model == "small"
    assert c.is_route
    assert fallbacks("unavailable") == before + 1
    # a route none of whose targets is served: no candidates, the targets to explain
    c = asyncio.run(chooser(pool, route("r", "gone", "also-gone")).choose("r", ""))
    assert not c.candidates
    assert c.is_route
    assert [str(t) for t in c.targets] == ["gone", "also-gone"]
    assert not asyncio.run(chooser(pool).choose("gone", "")).is_route


def test_a_prompt_too_long_for_the_first_target_moves_to_one_it_fits() -> None:
    pool = FakePool({("short", ""): (512, 100, True), ("long", ""): (8192, 100, True)})
    c = asyncio.run(chooser(pool, route("r", "short", "long")).choose("r", ""))
    assert c.max_context_length == 8192
    c.fit(100)
    assert c.model == "short"
    before = fallbacks("context")
    c.fit(600)
    assert c.model == "long"
    assert fallbacks("context") == before + 1
    c.fit(10_000)  # fits nowhere: stays, and the length check explains
    assert c.model == "long"
    # the output the request asks for counts too
    c = asyncio.run(chooser(pool, route("r", "short", "long")).choose("r", ""))
    c.fit(400, 111)
    assert c.model == "short"
    c.fit(400, 113)
    assert c.model == "long"


def test_next_targets_are_the_later_candidates_the_request_fits() -> None:
    served = {("a", ""): (2048, 100, True), ("tiny", ""): (256, 100, True)}
    pool = FakePool({**served, ("c", "v3"): (4096, 100, True)})
    c = asyncio.run(chooser(pool, route("r", "a", "tiny", "c@v3")).choose("r", ""))
    assert c.model == "a"
    assert c.next_targets(200) == (("tiny", ""), ("c", "v3"))
    assert c.next_targets(1000) == (("c", "v3"),)  # tiny cannot hold it
    c.fit(3000)  # only c holds it: nothing after it
    assert (c.model, c.next_targets(3001)) == ("c", ())
    assert asyncio.run(chooser(pool).choose("a", "")).next_targets(10) == ()


def test_only_targets_with_the_first_targets_vocabulary_are_fallbacks() -> None:
    pool = FakePool({("a", ""): (512, 100, True), ("b", ""): (8192, 999, True)})
    c = asyncio.run(chooser(pool, route("r", "a", "b")).choose("r", ""))
    assert [t.model for t, _ in c.candidates] == ["a"]


def test_routes_show_in_the_catalog() -> None:
    pool = FakePool({})
    entries = [ModelEntry("m", 2048, {"v1": (1, 1)}), ModelEntry("n", 1024, {"v1": (1, 1)})]
    ch = chooser(pool, route("chat", "m"), route("n", "n", "m"), route("ghost", "nowhere"))
    out = asyncio.run(ch.with_routes(entries))
    assert [(e.model, e.targets) for e in out] == [
        ("chat", ("m",)),
        ("m", ()),
        ("n", ("n", "m")),
    ]
    assert out[0].max_context_length == 2048


@pytest.mark.parametrize(
    ("name", "targets", "match"),
    [
        ("bad name", ("m",), "invalid route name"),
        ("r", (), "1 to 8 targets"),
        ("r", ("m", "m"), "twice"),
        ("r", ("m m",), "invalid target model"),
    ],
)
def test_invalid_routes_say_what_is_wrong(name: str, targets: tuple[str, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelRoute(name, tuple(RouteTarget(t) for t in targets))


def test_nothing_known_is_unavailable_and_says_why() -> None:
    ch = chooser(FakePool({}))
    choice = asyncio.run(ch.choose("m", ""))
    assert not choice.candidates
    error = ch.unknown("m", "", choice)
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert "no replica has answered yet" in error.message


def test_an_unknown_name_version_or_route_is_not_found_naming_what_is_served() -> None:
    pool = FakePool({("m", "v1"): (2048, 100, True), ("m", "v2"): (2048, 100, True)})
    ch = chooser(pool, route("chat", "gone"))
    for name, version, says in [
        ("x", "", "unknown model 'x'; available: m"),
        ("m", "v9", "known versions: v1, v2"),
        ("chat", "", "model route 'chat' sends requests to gone"),
    ]:
        choice = asyncio.run(ch.choose(name, version))
        assert not choice.candidates
        error = ch.unknown(name, version, choice)
        assert error.code == grpc.StatusCode.NOT_FOUND
        assert says in error.message


def test_an_unknown_name_names_only_the_models_the_caller_may_use() -> None:
    pool = FakePool({("m", "v1"): (2048, 100, True), ("secret", "v1"): (2048, 100, True)})
    ch = chooser(pool, route("chat", "gone"))
    allowed = {"m", "x", "chat"}.__contains__
    for name in ("x", "chat"):
        choice = asyncio.run(ch.choose(name, ""))
        error = ch.unknown(name, "", choice, allowed)
        assert error.code == grpc.StatusCode.NOT_FOUND
        assert "available: m" in error.message
        assert "secret" not in error.message
    everyone = ch.unknown("x", "", asyncio.run(ch.choose("x", "")))
    assert "secret" in everyone.message  # no restriction: every served model
