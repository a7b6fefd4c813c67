"""The Ray Serve request router of `kvstitch serve --replicas`: chunk affinity (`kvstitch.route.live`) over the
model replicas, from the digests they report (`record_routing_stats`, pulled by the Serve controller every
``request_routing_stats_period_s`` and broadcast to every router with the replica set).

It runs inside the process that holds the deployment handle (the ingress), on Serve's router loop. A request
names its passages in the ``route`` keyword argument of the call (``((passage key, tokens), ...)``); without
any, or when no replica holds them, the choice is power-of-two choices. Each router registers itself in
`kvstitch.route.live.ROUTERS` so the ingress can read the replicas' last reports (health, metrics) and count them.

Imports Ray Serve: import it only where the ``ray`` extra is required.
"""

from __future__ import annotations

from typing import List, Optional

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from kvstitch.route import live
from kvstitch.route.live import LiveRouter


def reports(deployment: str) -> dict[str, dict] | None:
    """Each live replica's last report, by replica id; None while no router of `deployment` exists here."""
    router = live.ROUTERS.get(deployment)
    if router is None:
        return None
    return {r.replica_id.unique_id: dict(r.routing_stats or {}) for r in list(router.curr_replicas.values())}


def route_chunks(pending: Optional[PendingRequest]) -> tuple:
    if pending is None:
        return ()
    chunks = pending.kwargs.get("route") or ()
    return tuple((str(k), int(t)) for k, t in chunks)


class ChunkAffinityRequestRouter(FIFOMixin, RequestRouter):
    """Most held context tokens against queue length (`kvstitch.route.router.ChunkAffinity`)."""

    def initialize_state(self, replicas: int = 2, lam: float = 0.5, slack: Optional[float] = 0.1, seed: int = 0,
                         **_):
        self.live = LiveRouter(replicas=replicas, seed=seed, lam=lam, slack=slack)
        self.last_choice: Optional[str] = None
        # Serve pickles this module by value into each handle's process: the registry lives in another module
        live.ROUTERS[self._deployment_id.name] = self

    def _sync(self) -> None:
        self.live.sync({r.replica_id.unique_id: r.routing_stats for r in self._replicas_list})

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        self._sync()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        order = self.live.rank(route_chunks(pending_request), list(by_id))
        self.last_choice = order[0] if order else None
        return [[by_id[name]] for name in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        self.live.placed(replica_id.unique_id)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        self.live.done(replica_id.unique_id)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.live.remove(replica_id.unique_id)  # what it held is gone with it
