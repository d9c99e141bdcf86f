"""Which model serves a request: the name it gives, through the model routes.

A request names a model (or a route: an alias, or a fallback chain under a
model's own name). ``ModelChooser.choose`` lists the route's targets that some
replica serves, those with a replica able to take a request now first, and
keeps only the ones with the first target's tokenizer (the prompt is
tokenized once). ``Choice.fit`` moves on to the next target when the prompt,
once counted, does not fit the chosen model's context; ``Choice.next_targets``
are where the dispatcher moves it when the chosen one is at capacity or fails
before the first token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from common.log import get_logger
from gateway import metrics
from gateway.domain import GatewayError
from gateway.fleet.replica_pool import ModelEntry, ReplicaPool
from gateway.release.model_routes import RouteCache, RouteTarget
from llm.v1 import engine_pb2

log = get_logger(__name__)


@dataclass(slots=True)
class Choice:
    """The candidates of one request, and the one chosen.

    Attributes:
        requested: The name in the request (model or route).
        targets: Where the name leads, in the route's order (the name itself if no route).
        candidates: (target, ModelInfo) in the order they are tried.
        index: The chosen candidate.
    """

    requested: str
    targets: tuple[RouteTarget, ...]
    candidates: list[tuple[RouteTarget, engine_pb2.ModelInfo]] = field(default_factory=list)
    index: int = 0

    @property
    def is_route(self) -> bool:
        """True when the requested name went through a model route."""
        return len(self.targets) != 1 or self.targets[0].model != self.requested

    @property
    def model(self) -> str:
        """The chosen model."""
        return self.candidates[self.index][0].model

    @property
    def version(self) -> str:
        """The chosen version ("" = any)."""
        return self.candidates[self.index][0].version

    @property
    def info(self) -> engine_pb2.ModelInfo:
        """ModelInfo of the chosen model."""
        return self.candidates[self.index][1]

    @property
    def max_context_length(self) -> int:
        """The largest context among the candidates (the bound a prompt must fit)."""
        return max(info.max_context_length for _, info in self.candidates)

    def next_targets(self, num_tokens: int) -> tuple[tuple[str, str], ...]:
        """The candidates after the chosen one whose context holds ``num_tokens`` (prompt
        and max_tokens), as (model, version): where the dispatcher goes when the chosen
        one is at capacity or fails before the first token. Same tokenizer as the
        chosen one, so the prompt's ids stand."""
        return tuple(
            (target.model, target.version)
            for target, info in self.candidates[self.index + 1 :]
            if num_tokens <= info.max_context_length
        )

    def fit(self, prompt_tokens: int, output_tokens: int = 1) -> None:
        """Move to the first candidate from the chosen one whose context holds the prompt
        and ``output_tokens`` (at least 1: the request's max_tokens or min_tokens); stay
        when none does (the length check then explains)."""
        need = prompt_tokens + max(1, output_tokens)
        for i in range(self.index, len(self.candidates)):
            if need <= self.candidates[i][1].max_context_length:
                if i != self.index:
                    log.info(
                        "prompt does not fit; falling back",
                        route=self.requested,
                        prompt_tokens=prompt_tokens,
                        from_model=self.model,
                        to_model=self.candidates[i][0].model,
                    )
                    metrics.MODEL_FALLBACKS.labels("context").inc()
                    self.index = i
                return


def same_tokenizer(a: engine_pb2.ModelInfo, b: engine_pb2.ModelInfo) -> bool:
    """True when token ids mean the same to both models (equal tokenizer digests;
    equal vocabulary sizes for engines that serve no tokenizer)."""
    return (a.tokenizer_digest, a.vocab_size) == (b.tokenizer_digest, b.vocab_size)


class ModelChooser:
    """Resolves request model names through the routes (None = no routes)."""

    def __init__(self, pool: ReplicaPool, routes: RouteCache | None = None) -> None:
        self.pool = pool
        self.routes = routes

    async def with_routes(self, entries: list[ModelEntry]) -> list[ModelEntry]:
        """The catalog plus one entry per route whose targets some replica serves (a
        route under a model's own name marks that model's entry with its targets)."""
        if self.routes is None:
            return entries
        by_name = {e.model: e for e in entries}
        for name, route in sorted((await self.routes.all()).items()):
            served = [by_name[t.model] for t in route.targets if t.model in by_name]
            if not served:
                continue
            targets = tuple(str(t) for t in route.targets)
            if name in by_name:
                by_name[name] = dataclasses.replace(by_name[name], targets=targets)
            else:
                first = served[0]
                by_name[name] = ModelEntry(name, first.max_context_length, {}, targets=targets)
        return sorted(by_name.values(), key=lambda e: e.model)

    async def targets(self, name: str, version: str) -> tuple[RouteTarget, ...]:
        """The route's targets, or ``name`` itself."""
        if self.routes is None:
            return (RouteTarget(name, version),)
        return await self.routes.targets(name, version)

    async def choose(self, name: str, version: str) -> Choice:
        """The candidates for ``name``; empty when no replica serves any target."""
        targets = await self.targets(name, version)
        known = []
        for t in targets:
            info = self.pool.model_info(t.model, t.version)
            if info is not None:
                known.append((t, info))
        if not known:
            return Choice(name, targets)
        ready = [c for c in known if self.pool.candidates(c[0].model, c[0].version, ())]
        ordered = ready + [c for c in known if c not in ready]
        first = ordered[0][1]
        same = [c for c in ordered if same_tokenizer(c[1], first)]
        if ordered[0][0] != targets[0]:
            metrics.MODEL_FALLBACKS.labels("unavailable").inc()
            log.info(
                "first target not served or no replica of it ready; falling back",
                route=name,
                from_model=str(targets[0]),
                to_model=str(ordered[0][0]),
            )
        return Choice(name, targets, same)

    def unknown(
        self,
        name: str,
        version: str,
        choice: Choice,
        allowed: Callable[[str], bool] = lambda model: True,
    ) -> GatewayError:
        """The answer to a request whose ``choice`` has no candidate: what is known, of
        the models the caller may use (``allowed``): no list of other tenants' models."""
        everything = self.pool.catalog()
        known = [e for e in everything if allowed(e.model)]
        if not everything:
            return GatewayError(
                grpc.StatusCode.UNAVAILABLE,
                "no engine replica is reachable yet, so no model is known: "
                + self.pool.explain(name, version, set()),
            )
        if choice.is_route:
            return GatewayError(
                grpc.StatusCode.NOT_FOUND,
                f"model route {name!r} sends requests to "
                f"{', '.join(str(t) for t in choice.targets)}, and no engine replica serves "
                f"any of them; available: {', '.join(e.model for e in known)}",
            )
        if version and any(e.model == name for e in known):
            versions = sorted(v for e in known if e.model == name for v in e.versions)
            return GatewayError(
                grpc.StatusCode.NOT_FOUND,
                f"model {name!r} has no version {version!r}; known versions: "
                f"{', '.join(versions)} (leave model_version empty for any)",
            )
        return GatewayError(
            grpc.StatusCode.NOT_FOUND,
            f"unknown model {name!r}; available: "
            f"{', '.join(e.model for e in known)} (empty = the default)",
        )
