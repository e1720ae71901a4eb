"""The Ray Serve pieces without a cluster: the session router's ranking and spreading, the
deployment's options, the CLI's --ray flags checked before anything starts, the replica's
session and health, and the proxy middleware when a replica is lost. The cluster itself is
tested in test_ray.py (helpers in tests/support/ray_support.py)."""

import asyncio
import json
import os

import pytest

# Ray turns token authentication on for a new local cluster (the CLI's); a driver that joins
# one by its address has to ask for it before Ray reads its configuration.
os.environ.setdefault("RAY_AUTH_MODE", "token")
pytest.importorskip("fastapi")
pytest.importorskip("ray.serve", reason="ray[serve] is not installed: pip install '.[ray]'")
openai = pytest.importorskip("openai")

from ray_support import health  # noqa: E402

from mlx_voicechat.serve.ray_proxy import CLOSE_REPLICA_LOST  # noqa: E402


def _router(cached=None):
    """A SessionRouter without Ray around it: Ray's queue-length cache is ``cached``."""
    from types import SimpleNamespace

    from mlx_voicechat.serve.ray_proxy import SessionRouter

    router = SessionRouter.__new__(SessionRouter)
    table = dict(cached or {})
    router._replica_queue_len_cache = SimpleNamespace(get=table.get)
    return router


def _replica(name, stats):
    from types import SimpleNamespace

    return SimpleNamespace(replica_id=name, routing_stats=stats)


def test_router_ranks_replicas_without_a_model_last():
    from mlx_voicechat.serve.ray_proxy import replica_rank

    assert replica_rank({}) == 0 and replica_rank({"ready": True}) == 0
    assert replica_rank({"ready": False}) == 1
    failed, fresh, ready = _replica("f", {"ready": False}), _replica("n", {}), _replica("r", None)
    ready.routing_stats = {"ready": True}
    ranks = asyncio.run(_router().choose_replicas([failed, fresh, ready]))
    assert ranks[-1] == [failed] and sorted(r[0].replica_id for r in ranks[:2]) == ["n", "r"]
    assert asyncio.run(_router().choose_replicas([ready])) == [[ready]]


def test_router_spreads_connections_that_arrive_together():
    # Three connections routed before Ray has confirmed any: Ray's cached lengths are the same
    # for both replicas, so without counting its own choices the router sent all three to one.
    a, b = _replica("a", {"ready": True}), _replica("b", {"ready": True})
    router = _router({"a": 0, "b": 0})

    async def three():
        return await asyncio.gather(*(router.choose_replicas([a, b]) for _ in range(3)))

    firsts = [ranks[0][0].replica_id for ranks in asyncio.run(three())]
    assert sorted(firsts) == ["a", "a", "b"]
    # Confirmed routes no longer count (Ray's cache has them), a busier replica comes last.
    for name in firsts:
        router.on_request_routed(None, name, None)
    router._replica_queue_len_cache.get = {"a": 5, "b": 1}.get
    assert [r[0].replica_id for r in asyncio.run(router.choose_replicas([a, b]))] == ["b", "a"]


def test_deployment_options():
    from mlx_voicechat.serve.ray_app import CONTROL_SLOTS, app_builder, deployment_options

    fixed = deployment_options(max_sessions=3, replicas=2)
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    # a full replica still takes the connection, to answer server_busy, and /health
    assert fixed["max_ongoing_requests"] == 3 + CONTROL_SLOTS
    router = fixed["request_router_config"].request_router_class
    assert router == "mlx_voicechat.serve.ray_proxy.SessionRouter"
    assert fixed["ray_actor_options"] == {"num_cpus": 1}
    auto = deployment_options(max_sessions=2, min_replicas=1, max_replicas=4)["autoscaling_config"]
    assert (auto["min_replicas"], auto["max_replicas"]) == (1, 4)
    assert 0 < auto["target_ongoing_requests"] < 2  # scale up before the replicas are full
    for bad in ({"replicas": 2, "max_replicas": 3}, {"max_sessions": 0}, {"replicas": 0}):
        with pytest.raises(ValueError):
            deployment_options(**bad)
    with pytest.raises(ValueError, match="unknown argument"):
        app_builder({"model": "m", "max_session": 2})
    with pytest.raises(ValueError, match="'model'"):
        app_builder({"replicas": 2})


def test_cli_ray_flags_are_checked_before_anything_starts(capsys):
    from mlx_voicechat.cli import main

    assert main(["serve", "--model", "m", "--replicas", "2"]) == 2
    assert "--replicas needs --ray" in capsys.readouterr().err
    assert main(["serve", "--model", "m", "--ray", "--replicas", "2", "--max-replicas", "3"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["serve", "--model", "m", "--ray", "--min-replicas", "3", "--max-replicas", "2"])
    assert "--min-replicas <= --max-replicas" in capsys.readouterr().err


def test_session_created_names_the_replica_and_health_takes_extra_fields():
    from mlx_voicechat.serve.app import ServerThread, create_app
    from mlx_voicechat.serve.protocol import Realtime

    created = Realtime("m").open({"replica": "r1"})[0]
    assert created["type"] == "session.created" and created["x-voicechat"] == {"replica": "r1"}
    assert "x-voicechat" not in Realtime("m").open()[0]

    async def extra():
        return {"replica": "r1", "deployment": {"capacity": 4}}

    app = create_app(None, warmup=False, health_extra=extra, vendor={"replica": "r1"})
    assert app.state.server.vendor == {"replica": "r1"}
    with ServerThread(app) as s:
        _, h = health(s.url)
    assert h["status"] == "ok" and h["replica"] == "r1" and h["deployment"] == {"capacity": 4}


def _through_middleware(inner, path="/v1/realtime", client=()):
    """What :class:`ReplicaLossMiddleware` sends to the client around ``inner``."""
    from mlx_voicechat.serve.ray_proxy import ReplicaLossMiddleware

    sent, incoming = [], list(client) or [{"type": "websocket.connect"}]

    async def receive():
        return incoming.pop(0) if incoming else await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    scope = {"type": "websocket", "path": path}
    asyncio.run(asyncio.wait_for(ReplicaLossMiddleware(inner)(scope, receive, send), 5))
    return sent


def test_a_session_whose_replica_is_lost_gets_an_error_and_1012():
    async def dies_after_accept(scope, receive, send):
        await receive()
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.send", "text": "{}"})

    sent = _through_middleware(dies_after_accept)
    kinds = ["websocket.accept", "websocket.send", "websocket.send", "websocket.close"]
    assert [m["type"] for m in sent] == kinds
    error = json.loads(sent[2]["text"])
    assert error["type"] == "error" and error["error"]["code"] == "replica_lost"
    assert (sent[3]["code"], sent[3]["reason"]) == (CLOSE_REPLICA_LOST, "replica lost")

    async def unavailable(scope, receive, send):  # the proxy's HTTP error for a WebSocket
        await send({"type": "http.response.start", "status": 503, "headers": []})
        await send({"type": "http.response.body", "body": b"no replicas"})

    sent = _through_middleware(unavailable)
    assert [m["type"] for m in sent] == ["websocket.accept", "websocket.send", "websocket.close"]
    assert json.loads(sent[1]["text"])["error"]["code"] == "server_unavailable"
    assert sent[2]["code"] == 1013

    async def closes(scope, receive, send):
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.close", "code": 1013, "reason": "server busy"})

    assert _through_middleware(closes)[-1] == {
        "type": "websocket.close",
        "code": 1013,
        "reason": "server busy",
    }
    assert len(_through_middleware(dies_after_accept, path="/other")) == 2  # not ours

    async def client_left(scope, receive, send):
        await send({"type": "websocket.accept"})
        assert (await receive())["type"] == "websocket.disconnect"

    gone = [{"type": "websocket.disconnect", "code": 1000}]
    assert [m["type"] for m in _through_middleware(client_left, client=gone)] == [
        "websocket.accept"
    ]
