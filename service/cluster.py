"""Replicas on Ray Serve: N engine replicas behind one HTTP ingress, sessions routed to the replica
that holds them (`s5serve cluster`, or `serve run service.cluster:build`).

    HTTP -> Ray Serve's proxy -> `Gateway` (stateless; reads the request's session id) --handle-->
         `EngineReplica` x N (each the whole `s5serve serve` app and its own engine process)

- `EngineReplica` runs the same FastAPI app as `s5serve serve` (service/app.py) in the replica:
  every route, SSE streaming, auth, limits and metrics are those of the single server. Requests
  reach it as plain data (`HTTPCall`) and its responses go back as a stream: the response head,
  then body chunks as the app sends them. A client that goes away cancels the stream, which the
  app sees as a disconnect (its request is aborted at the engine's next step). Every response
  carries `X-S5-Replica`, the replica that served it.
- `Gateway` finds the request's session (the path of a session route, an `X-Session-Id` header, a
  `session_id` field of an OpenAI body) and calls the replicas through a handle with that session
  id; `service/routing.py`'s router sends each session to one replica (consistent hashing) and
  requests without one to the less loaded of two (queue length, KV use).
- Sessions live in a shared PostgreSQL store (`--session-db postgresql://...`): when a replica
  dies or drains, its sessions hash to other replicas, which rebuild their rows from the stored
  transcripts; each turn holds the session's lease in the store, so two replicas never run turns
  of one session at once (engine/core/session_sync.py).

A replica whose engine process dies fails its health check and Ray Serve replaces it; streams it
was serving end with an error event from the gateway.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path

from service.settings import Settings

log = logging.getLogger("s5serve")

REPLICA_HEADER = "x-s5-replica"  # names the replica that served a response
ENGINE_DEPLOYMENT = "EngineReplica"
GATEWAY_DEPLOYMENT = "Gateway"
APP_NAME = "s5serve"
_SESSION_PATH = re.compile(r"^/v1/sessions/([^/]+)")
_OPENAI_BODY_ROUTES = ("/v1/completions", "/v1/chat/completions")
_CANCEL_PATH = re.compile(r"^/v1/requests/([^/]+)/cancel$")


@dataclass(frozen=True)
class ClusterSettings:
    serve: Settings  # what every replica serves with (its host and port are the ingress's)
    replicas: int = 2
    replica_cpus: float = 1.0  # Ray CPUs each replica reserves
    replica_gpus: float = 0.0  # GPUs each replica reserves (a fraction shares one GPU)
    gateways: int = 1  # gateway replicas (stateless)
    # a replica past this many requests in flight refuses more; a session's request then goes to
    # the next replica on its ring (bounded load)
    max_ongoing_requests: int = 0  # 0: the serve settings' queue size
    # A response's chunks cross Ray (replica -> gateway -> Serve's proxy) as one message each, at a
    # cost per message. A replica keeps its streams' messages within `stream_messages_per_s` in
    # all: with S streams live, each sends at most once per S / rate seconds (never less often
    # than once per `stream_interval_s`), the chunks that arrive meanwhile joined. One stream
    # sends each token as it comes; 64 send every 20 ms. A rate of 0: every stream waits
    # `stream_interval_s` (0 too: every chunk as it comes).
    stream_interval_s: float = 0.02
    stream_messages_per_s: float = 3000.0


@dataclass(frozen=True)
class HTTPCall:
    """A request as the gateway hands it to a replica."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None


def session_key(path: str, headers, body: bytes) -> str:
    """The session a request belongs to ("" for none), found as the routes find it: a session
    route's path; for the OpenAI routes, the body's session_id, else an X-Session-Id header."""
    m = _SESSION_PATH.match(path)
    if m:
        return m.group(1)
    if path not in _OPENAI_BODY_ROUTES:
        return ""
    if b'"session_id"' in body:
        try:
            value = json.loads(body).get("session_id")
        except (ValueError, AttributeError):
            value = None  # the replica answers a malformed body with a 400
        if isinstance(value, str) and value:
            return value
    return headers.get("x-session-id") or ""


def send_interval(streams: int, longest_s: float, messages_per_s: float) -> float:
    """How long a stream waits after a message before its next one, with `streams` live on the
    replica (see ClusterSettings): their messages within `messages_per_s` in all, never longer
    than `longest_s`; a rate of 0: `longest_s`."""
    if messages_per_s <= 0:
        return longest_s
    return min(longest_s, streams / messages_per_s)


class EngineReplica:
    """One replica: the `s5serve serve` app and its engine process, driven over ASGI in-process."""

    async def __init__(self, settings: Settings, stream_interval_s: float = 0.0,
                       stream_messages_per_s: float = 0.0) -> None:
        from ray import serve

        from service.app import create_app

        self.app = create_app(settings)
        self.stream_interval_s = stream_interval_s
        self.stream_messages_per_s = stream_messages_per_s
        self.streams = 0  # responses being sent
        self.state = self.app.state.s5
        self.name = serve.get_replica_context().replica_id.unique_id.encode()
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()  # starts the engine process
        while not self.state.ready:
            if self.state.load_error or self.state.fatal:
                raise RuntimeError(f"replica failed to start: {self.state.load_error or self.state.fatal}")
            await asyncio.sleep(0.05)

    async def abort_in_flight(self) -> int:
        """End every request this replica runs at the engine's next step: its stream then ends
        with finish reason `abort` and `[DONE]`, as a single server ends those past its drain
        grace. Returns how many."""
        ids = self.state.active.ids()
        for rid in ids:
            self.state.engine.abort(rid)
        return len(ids)

    async def handle(self, call: HTTPCall) -> AsyncIterator[dict | bytes]:
        """The app's response to `call`: a head ({"status", "headers"}), then body chunks."""
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": call.method, "scheme": "http", "path": call.path, "raw_path": call.path.encode(),
                 "query_string": call.query_string, "root_path": "", "headers": call.headers,
                 "client": call.client, "server": ("s5serve-replica", 0)}
        sent: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()  # the caller went away (the stream was cancelled or closed)
        body = [call.body]

        async def receive() -> dict:
            if body:
                return {"type": "http.request", "body": body.pop(), "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            await sent.put(message)

        task = asyncio.create_task(self.app(scope, receive, send))
        task.add_done_callback(lambda _: sent.put_nowait(None))
        loop = asyncio.get_running_loop()
        next_send = 0.0  # when this stream may send its next message
        self.streams += 1
        try:
            while (message := await sent.get()) is not None:
                if message["type"] == "http.response.start":
                    headers = [*message.get("headers", []), (REPLICA_HEADER.encode(), self.name)]
                    yield {"status": message["status"], "headers": headers}
                elif message["type"] == "http.response.body":
                    # chunks are whole SSE events: joined, they are the same stream in fewer messages
                    chunks, more = [message.get("body", b"")], message.get("more_body", False)
                    while more:
                        wait = next_send - loop.time()
                        if sent.empty() and wait <= 0:
                            break
                        try:  # what arrives before this stream's next send goes with it
                            queued = sent.get_nowait() if not sent.empty() else await asyncio.wait_for(
                                sent.get(), wait)
                        except TimeoutError:
                            break
                        if queued is None:  # the app ended: the loop ends after this message
                            sent.put_nowait(None)
                            break
                        chunks.append(queued.get("body", b""))
                        more = queued.get("more_body", False)
                    if any(chunks):
                        yield b"".join(chunks)
                        next_send = loop.time() + send_interval(self.streams, self.stream_interval_s,
                                                                self.stream_messages_per_s)
                    if not more:
                        break
            if task.done() and task.exception() is not None:
                raise task.exception()
        finally:
            self.streams -= 1
            gone.set()  # the app sees a disconnect: a request still running is aborted
            done, _ = await asyncio.wait({task}, timeout=10)
            if not done:
                task.cancel()

    async def record_routing_stats(self) -> dict:
        """What the router weighs for requests without a session (service/routing.py)."""
        if not self.state.ready or self.state.engine is None or not self.state.engine.alive:
            return {}
        st = await self.state.engine.fresh_stats()
        return {"num_requests_waiting": st.num_waiting, "num_requests_running": st.num_running,
                "kv_cache_usage_perc": st.kv_block_utilization}

    async def check_health(self) -> None:
        """Ray Serve replaces a replica whose engine process died."""
        if self.state.fatal:
            raise RuntimeError(self.state.fatal)

    async def __del__(self) -> None:
        """Drained and stopped (Ray Serve waited for its requests in flight): stop the engine."""
        self.state.draining = True
        await self._lifespan.__aexit__(None, None, None)


class Gateway:
    """The HTTP ingress: forwards every request to the replica its session maps to.

    Request ids: Ray Serve's proxy gives every response an `X-Request-Id` of its own (the one a
    client sent, or one it made), so that is the id a client sees; the gateway drops the replica
    app's own header and keeps, for each request in flight, which replica runs it under which id,
    so that `POST /v1/requests/{id}/cancel` reaches that replica with the app's id. (With several
    gateway replicas, a cancel may reach a gateway that did not forward the request: it then answers
    404 request_not_found, and closing the request's connection cancels it as well.)
    """

    def __init__(self, engines, max_body_bytes: int) -> None:
        self.engines = engines  # DeploymentHandle of EngineReplica
        self.max_body_bytes = max_body_bytes
        self.in_flight: dict[str, tuple[str, str]] = {}  # client's request id -> (replica, app's id)
        # responses begun and not yet ended (a response whose body never started iterating, its
        # client gone first, stays counted: a drain then waits out its grace instead of cutting)
        self.active = 0
        self.draining = False  # `drain`: new requests get 503, responses in flight run on

    async def drain(self) -> tuple[str, int]:
        """Stop taking requests (503 `draining`, as a single server's drain answers); returns this
        gateway's replica id and its responses still in flight. Idempotent: the driver polls it."""
        from ray import serve

        self.draining = True
        return serve.get_replica_context().replica_id.unique_id, self.active

    async def __call__(self, request):
        from ray.serve.exceptions import BackPressureError
        from starlette.responses import JSONResponse, StreamingResponse

        from service.errors import envelope

        if self.draining:
            return JSONResponse(envelope(503, "server is draining", "draining"), status_code=503,
                                headers={"Retry-After": "5"})
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                return JSONResponse(envelope(413, f"request body exceeds {self.max_body_bytes} bytes",
                                             "body_too_large"), status_code=413)
        path = request.url.path
        key = session_key(path, request.headers, body)
        handle = self.engines.options(stream=True, session_id=key) if key else self.engines.options(stream=True)
        cancel = _CANCEL_PATH.match(path)
        if cancel and cancel.group(1) in self.in_flight:  # to the replica that runs it, by the app's id
            replica, app_id = self.in_flight[cancel.group(1)]
            path = f"/v1/requests/{app_id}/cancel"
            handle = self.engines.options(stream=True, multiplexed_model_id=_target_replica(replica))
        call = HTTPCall(request.method, path, request.url.query.encode(), list(request.headers.raw), body,
                        (request.client.host, request.client.port) if request.client else None)
        stream = handle.handle.remote(call)
        self.active += 1
        try:
            head = await stream.__anext__()
        except BackPressureError:  # every replica full and the gateway's queue too
            self.active -= 1
            return JSONResponse(envelope(429, "too many requests in flight; retry later", "queue_full"),
                                status_code=429, headers={"Retry-After": "1"})
        except Exception as exc:  # no replica answered (it died before its response began)
            self.active -= 1
            log.warning("%s %s: no replica answered: %s", request.method, path, exc)
            stream.cancel()
            return JSONResponse(envelope(503, "the replica serving this request failed; retry", "replica_failed"),
                                status_code=503, headers={"Retry-After": "1"})
        headers = {k.lower(): v for k, v in head["headers"]}
        event_stream = headers.get(b"content-type", b"").startswith(b"text/event-stream")
        client_id = request.headers.get("x-request-id")  # what Ray's proxy answers with
        if client_id and b"x-request-id" in headers:
            self.in_flight[client_id] = (headers[REPLICA_HEADER.encode()].decode(), headers[b"x-request-id"].decode())

        async def chunks():
            try:
                async for chunk in stream:
                    yield chunk
            except Exception as exc:  # the replica died mid-response
                log.warning("%s %s: the replica failed mid-response: %s", request.method, path, exc)
                if event_stream:
                    yield b"data: " + json.dumps(envelope(
                        503, "the replica serving this request failed; the turn did not complete",
                        "replica_failed")).encode() + b"\n\n"
                    yield b"data: [DONE]\n\n"
            finally:
                stream.cancel()
                self.in_flight.pop(client_id, None)
                self.active -= 1

        response = StreamingResponse(chunks(), status_code=head["status"])
        response.raw_headers = [(k, v) for k, v in head["headers"]
                                if k.lower() not in (b"transfer-encoding", b"x-request-id")]
        return response


def _target_replica(replica: str) -> str:
    from service.routing import TARGET_REPLICA  # imports Ray: only where Ray runs

    return TARGET_REPLICA + replica


def build_app(cluster: ClusterSettings):
    """The Ray Serve application: the gateway bound to N engine replicas."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from ray.serve.schema import LoggingConfig

    from service.routing import SessionAffinityRouter

    s = cluster.serve
    quiet = LoggingConfig(log_level="WARNING", enable_access_log=False)  # the app logs what matters
    replica_settings = replace(s, host="127.0.0.1", port=0)
    engines = serve.deployment(EngineReplica).options(
        name=ENGINE_DEPLOYMENT,
        num_replicas=cluster.replicas,
        ray_actor_options={"num_cpus": cluster.replica_cpus, "num_gpus": cluster.replica_gpus},
        max_ongoing_requests=cluster.max_ongoing_requests or s.max_queued,
        # past this many requests waiting in a gateway for a replica, it answers 429
        max_queued_requests=s.max_queued,
        request_router_config=RequestRouterConfig(request_router_class=SessionAffinityRouter,
                                                  request_routing_stats_period_s=1.0,
                                                  request_routing_stats_timeout_s=5.0),
        health_check_period_s=2.0,
        health_check_timeout_s=30.0,
        graceful_shutdown_wait_loop_s=0.5,
        graceful_shutdown_timeout_s=s.drain_grace_s,
        logging_config=quiet,
    ).bind(replica_settings, cluster.stream_interval_s, cluster.stream_messages_per_s)
    gateway = serve.deployment(Gateway).options(
        name=GATEWAY_DEPLOYMENT, num_replicas=cluster.gateways, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=100_000, logging_config=quiet,
    ).bind(engines, s.max_body_bytes)
    return gateway


def runtime_env() -> dict:
    """What Ray's worker processes need to import this project as the driver does: its root first
    on the import path, then the driver's own PYTHONPATH (which may be where Ray itself and the
    other packages are installed; the env var replaces the workers' inherited one)."""
    root = str(Path(__file__).resolve().parent.parent)
    inherited = os.environ.get("PYTHONPATH", "")
    return {"env_vars": {"PYTHONPATH": os.pathsep.join([root, *(p for p in inherited.split(os.pathsep) if p)])}}


def build(args: dict):
    """`serve run service.cluster:build replicas=2 session-db=postgresql://...`: the application,
    configured as `s5serve cluster` (keys are its flags without the dashes)."""
    argv = []
    for key, value in args.items():
        argv += [f"--{key}", str(value)]
    return build_app(parse_cluster_args(argv))


# ---- s5serve cluster ------------------------------------------------------------------------------
def cluster_parser():
    from service.settings import serve_parser

    p = serve_parser()
    p.prog = "s5serve cluster"
    p.epilog = ("Every flag of s5serve serve has an environment variable (shown with it): a flag on the command "
                "line wins over the variable, the variable over the default; the cluster's own flags (the "
                "cluster group above) are flags only. Byte counts take K, M, G suffixes (powers of 1024).")
    p.description = ("Serve a model from N replicas on Ray Serve behind one HTTP ingress (the routes of "
                     "s5serve serve); each session is served by one replica, and sessions are shared "
                     "through PostgreSQL (--session-db postgresql://...).")
    g = p.add_argument_group("cluster")
    g.add_argument("--replicas", type=int, default=2, help="engine replicas [default: 2]")
    g.add_argument("--replica-cpus", type=float, default=1.0,
                   help="Ray CPUs each replica reserves (0: any number per machine) [default: 1]")
    g.add_argument("--replica-gpus", type=float, default=None,
                   help="GPUs each replica reserves; 0.5 puts two replicas on one GPU "
                        "[default: 1 with --device cuda, else 0]")
    g.add_argument("--gateways", type=int, default=1, help="ingress replicas (stateless) [default: 1]")
    g.add_argument("--stream-messages-per-s", type=float, default=3000.0,
                   help="the messages a replica's streams send through Ray in all: with S streams, each "
                        "sends at most once per S / this many seconds, the tokens made meanwhile "
                        "together (each message through Ray costs; under load fewer, larger ones keep "
                        "up with the engine); 0: every stream waits --stream-interval-ms [default: 3000]")
    g.add_argument("--stream-interval-ms", type=float, default=20.0,
                   help="the longest a stream's tokens wait to be sent; with --stream-messages-per-s 0, "
                        "how long each waits (0: each as it comes) [default: 20]")
    g.add_argument("--ray-address", default=None,
                   help="a running Ray cluster to join (auto: the one started on this machine by "
                        "`ray start`); default: start Ray in this process, on this machine only")
    return p


def parse_cluster_args(argv: list[str] | None = None) -> ClusterSettings:
    from service.settings import parse_serve_args

    p = cluster_parser()
    a = p.parse_args(argv)
    settings = parse_serve_args(argv, parser=p)
    db = settings.engine.session_db
    from engine.core.session_db import is_postgres_url

    if a.replicas < 1:
        p.error("--replicas must be at least 1")
    if a.replica_cpus < 0 or (a.replica_gpus is not None and a.replica_gpus < 0) or a.gateways < 1:
        p.error("--replica-cpus and --replica-gpus must be at least 0, --gateways at least 1")
    if settings.api_servers not in (None, 1):
        p.error("--api-servers is s5serve serve's: a cluster's replicas serve through Ray Serve's HTTP proxy "
                "(--gateways sets how many)")
    if a.replicas > 1 and db is not None and not is_postgres_url(db):
        p.error("replicas share their sessions through PostgreSQL: give --session-db postgresql://... "
                "(or --session-db none: sessions in memory, lost with their replica)")
    gpus = a.replica_gpus if a.replica_gpus is not None else (1.0 if settings.engine.device.startswith("cuda") else 0.0)
    if a.stream_interval_ms < 0 or a.stream_messages_per_s < 0:
        p.error("--stream-interval-ms and --stream-messages-per-s must be at least 0")
    return ClusterSettings(serve=settings, replicas=a.replicas, replica_cpus=a.replica_cpus, replica_gpus=gpus,
                           gateways=a.gateways, stream_interval_s=a.stream_interval_ms / 1e3,
                           stream_messages_per_s=a.stream_messages_per_s)


def connect(ray_address: str | None = None) -> None:
    """Ray: the cluster at `ray_address` joined, or started here (None), unless already up."""
    import ray

    if not ray.is_initialized():
        ray.init(address=ray_address, runtime_env=runtime_env(), include_dashboard=False,
                 configure_logging=True, logging_level=logging.WARNING)


def resource_problem(cluster: ClusterSettings) -> str | None:
    """Why the replicas cannot all be placed on the Ray cluster as it is (Serve would wait for
    them forever), or None."""
    import ray

    have = ray.cluster_resources()
    for kind, each, flag in (("CPU", cluster.replica_cpus, "--replica-cpus"), ("GPU", cluster.replica_gpus,
                                                                                "--replica-gpus")):
        need = cluster.replicas * each
        if need > have.get(kind, 0.0) + 1e-9:
            return (f"{cluster.replicas} replicas x {each:g} {kind}{'' if each == 1 else 's'} each need {need:g} "
                    f"{kind}s, and the Ray "
                    f"cluster has {have.get(kind, 0.0):g}: start fewer replicas, or a smaller {flag}"
                    + (" (0: any number per machine)" if kind == "CPU" else ""))
    return None


def drain(cluster: ClusterSettings, poll_s: float = 0.2, end_s: float = 5.0) -> bool:
    """The gateways stop taking requests (503 `draining`) and responses in flight get the serve
    settings' drain grace to end; past it, every engine replica ends the requests it still runs
    (finish reason `abort`), and their streams get `end_s` more to deliver that. True if every
    gateway reported none left within the grace."""
    import time

    from ray import serve

    gateways = serve.get_deployment_handle(GATEWAY_DEPLOYMENT, app_name=APP_NAME)
    left: dict[str, int] = {}  # gateway replica -> its responses in flight, as last reported

    def wait(until: float) -> bool:
        while True:
            replica, active = gateways.drain.remote().result(timeout_s=30)
            left[replica] = active
            if len(left) >= cluster.gateways and not any(left.values()):
                return True
            if time.monotonic() >= until:
                return False
            time.sleep(poll_s)

    if wait(time.monotonic() + cluster.serve.drain_grace_s):
        return True
    engines = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=APP_NAME)
    for replica in engine_replicas():
        engines.options(multiplexed_model_id=_target_replica(replica)).abort_in_flight.remote().result(timeout_s=30)
    wait(time.monotonic() + end_s)
    return False


def engine_replicas() -> set[str]:
    """The unique ids of the engine replicas' live actors."""
    import ray

    prefix = f"SERVE_REPLICA::{APP_NAME}#{ENGINE_DEPLOYMENT}#"
    return {a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)}


def start(cluster: ClusterSettings, ray_address: str | None = None) -> None:
    """Ray (joined or started here: `connect`), Serve's HTTP proxy on the serve settings' host
    and port, and the application; returns once every replica is ready."""
    from ray import serve

    connect(ray_address)
    serve.start(http_options={"host": cluster.serve.host, "port": cluster.serve.port},
                logging_config={"log_level": "WARNING", "enable_access_log": False})
    serve.run(build_app(cluster), name=APP_NAME, route_prefix="/", blocking=False)


def stop() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def main(argv: list[str]) -> int:
    import signal
    import threading

    from service.settings import exposure_warning

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cluster = parse_cluster_args(argv)
    address = cluster_parser().parse_args(argv).ray_address
    if (warning := exposure_warning(cluster.serve)) is not None:
        log.warning(warning)
    if cluster.serve.engine.model == "embedded":
        from engine.model.source import embedded_dir

        print("preparing the embedded model (converted once, then cached)...", flush=True)
        embedded_dir(cluster.serve.engine.cache_dir, report=lambda line: print(line, flush=True))
    ready, stopping = threading.Event(), threading.Event()

    def on_signal(*_):
        if not ready.is_set() or stopping.is_set():  # still starting, or a second signal: stop now
            raise KeyboardInterrupt
        stopping.set()

    connect(address)  # before the handlers: starting Ray installs a SIGTERM handler of its own
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        if address is None and (problem := resource_problem(cluster)) is not None:
            print(f"s5serve cluster: {problem}", file=sys.stderr)
            stop()
            return 2
        start(cluster, address)
    except KeyboardInterrupt:
        log.info("stopped while starting")
        stop()
        return 1
    ready.set()
    log.info("s5serve cluster ready: %d replicas on http://%s:%d", cluster.replicas, cluster.serve.host,
             cluster.serve.port)
    print(f"ready: {cluster.replicas} replicas on http://{cluster.serve.host}:{cluster.serve.port}", flush=True)
    stopping.wait()
    log.info("draining: new requests get 503; responses in flight get up to %.0f s", cluster.serve.drain_grace_s)
    try:
        if not drain(cluster):
            log.warning("drain grace over: the requests still running were ended (finish reason abort)")
    except KeyboardInterrupt:
        log.warning("a second signal: stopping now")
    stop()
    return 0
