"""SessionAffinityRouter: Ray Serve's request router for the engine replicas (service/cluster.py).

- A request of a session (the gateway passes its id as the handle's `session_id`) goes to the
  replica that the session id maps to on a consistent-hash ring of the running replicas (Ray
  Serve's ConsistentHashRouter: virtual nodes, the same map in every router). While the replicas
  stay the same, every request of a session reaches one replica, the one holding its row. A
  replica that leaves (it died, or it drains) moves only its own sessions, each to its next
  replica on the ring, which rebuilds the row from the shared store. Load is bounded: a replica
  with `max_ongoing_requests` in flight refuses more, and the session's request tries the next
  replicas on its ring.
- A request without a session goes to the less loaded of two replicas drawn at random (power of
  two choices on the queue lengths the router probes), drawn among the replicas whose KV cache is
  not nearly full (`kv_cache_usage_perc`, reported by each replica's record_routing_stats) where
  there are any.
- A request the gateway addresses to one replica (`TARGET_REPLICA`) goes there.
"""

from __future__ import annotations

import random

from ray.serve.experimental.consistent_hash_router import ConsistentHashRouter

KV_NEARLY_FULL = 0.9  # replicas above this share of KV blocks in use are passed over for new work


# The gateway's way to name one replica (a request cancel goes to the replica running the request):
# a handle's multiplexed model id of this form (the replicas multiplex no models).
TARGET_REPLICA = "s5-replica:"


class SessionAffinityRouter(ConsistentHashRouter):
    async def choose_replicas(self, candidate_replicas, pending_request=None):
        target = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if target.startswith(TARGET_REPLICA):
            named = [r for r in candidate_replicas if r.replica_id.unique_id == target[len(TARGET_REPLICA):]]
            return [named or candidate_replicas]  # gone: any replica answers that it runs no such request
        if pending_request is None or pending_request.metadata.session_id:
            return await super().choose_replicas(candidate_replicas, pending_request)
        if not candidate_replicas:
            return []
        roomy = [r for r in candidate_replicas
                 if (r.routing_stats or {}).get("kv_cache_usage_perc", 0.0) < KV_NEARLY_FULL] or candidate_replicas
        return [random.sample(roomy, min(2, len(roomy)))]
