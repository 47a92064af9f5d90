"""Production controls of the fleet, end to end over loopback: retries with exponential backoff on
the statuses listed in `fleet.retry_on_status`, the per-server circuit breaker
(`fleet.circuit_breaker`) and the token-bucket rate limit with its bounded queue
(`fleet.rate_limit`). The misbehaving servers are stand-ins in this process (every POST answered
with one status); the fleet and the good worker are real processes.
"""
from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from .conftest import NO_SHEDDING, group, healthy, http, metric, wait_for
from .stand_ins import StatusServer

BODY = {"model": "tiny", "prompt": "hello there", "max_tokens": 2}


@pytest.fixture
def stand_ins():
    made = []

    def make(status: int) -> StatusServer:
        s = StatusServer(status)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


@pytest.fixture(scope="module")
def good(module_cluster):
    """One real generation worker for the module: the tests only send it completions, and its
    start-up is most of a test's cost on a 2-core CI box."""
    return module_cluster.worker("generation", name="controls-gen")[1]


def start_fleet(cluster, gen_urls, **fleet_cfg):
    from .conftest import free_port
    port = free_port()
    top = {k: fleet_cfg.pop(k) for k in ("max_retries",) if k in fleet_cfg}
    cfg = cluster.config(port=port, generation_servers=group(gen_urls),
                         context_servers={"urls": []}, coordinator=NO_SHEDDING,
                         fleet=fleet_cfg, **top)
    p = cluster.fleet(cfg)
    base = f"http://127.0.0.1:{port}"
    wait_for(lambda: healthy(base), 60, "fleet", p)
    return base


def test_listed_5xx_are_retried_elsewhere_with_a_growing_backoff(cluster, stand_ins):
    bad = [stand_ins(500) for _ in range(4)]
    base = start_fleet(cluster, [b.url for b in bad], max_retries=3, retry_on_status=[500],
                       retry_backoff_s=0.2, retry_backoff_multiplier=2.0, retry_backoff_max_s=5.0)
    st, h, body = http("POST", base + "/v1/completions", BODY)
    # four attempts, each on a server not tried yet: all 500
    assert st == 502, body
    assert "gave up after 4 attempt(s)" in json.loads(body)["error"]["message"]
    times = sorted(t for b in bad for t in b.hits)
    assert len(times) == 4, [len(b.hits) for b in bad]
    gaps = [b - a for a, b in zip(times, times[1:])]
    # pauses are 0.2 * 2^n, jittered x0.5-1.5: at least 0.1, 0.2, 0.4 s
    assert gaps[0] >= 0.1 and gaps[1] >= 0.2 and gaps[2] >= 0.4, gaps
    m = http("GET", base + "/metrics")[2].decode()
    assert metric(m, "splitserve_fleet_leg_retries_total", role="generation") == 3


def test_a_429_is_retried_on_another_server_and_the_client_sees_200(cluster, stand_ins, good):
    busy = stand_ins(429)
    base = start_fleet(cluster, [busy.url, good], max_retries=1, retry_on_status=[429, 503],
                       retry_backoff_s=0.01)
    statuses = [http("POST", base + "/v1/completions", BODY)[0] for _ in range(4)]
    assert statuses == [200] * 4
    assert len(busy.hits) >= 1           # round robin sent some requests there first
    # shedding is not a failure: the busy server's breaker stays closed, it keeps getting its turn
    assert len(busy.hits) >= 2


def test_the_circuit_breaker_opens_after_the_threshold_and_half_opens_later(cluster, stand_ins, good):
    bad = stand_ins(500)
    base = start_fleet(cluster, [bad.url, good], max_retries=1, retry_on_status=[500],
                       retry_backoff_s=0.01, circuit_breaker={"failure_threshold": 2, "open_s": 2.5})
    t_open = None
    for _ in range(8):
        assert http("POST", base + "/v1/completions", BODY)[0] == 200
        if len(bad.hits) == 2 and t_open is None:
            t_open = time.monotonic()
    assert len(bad.hits) == 2            # open: no traffic from this process after 2 failures
    assert time.monotonic() - t_open < 2.5, "the requests took longer than open_s; inconclusive"
    time.sleep(max(0.0, 2.7 - (time.monotonic() - t_open)))
    for _ in range(3):                   # half-open: traffic again, which fails and reopens it
        assert http("POST", base + "/v1/completions", BODY)[0] == 200
    assert len(bad.hits) == 3
    m = http("GET", base + "/metrics")[2].decode()
    assert metric(m, "splitserve_fleet_server_ejections_total", server=bad.url) >= 1


def test_the_rate_limit_admits_the_burst_queues_one_and_refuses_the_rest(cluster, good):
    base = start_fleet(cluster, [good], rate_limit={"requests_per_s": 2, "burst": 2,
                                                    "max_queue": 1, "queue_timeout_s": 5.0})
    time.sleep(1.1)                      # the bucket is full again after the readiness probes
    with ThreadPoolExecutor(5) as ex:
        answers = list(ex.map(lambda _: http("POST", base + "/v1/completions", BODY, timeout=20),
                              range(5)))
    statuses = sorted(a[0] for a in answers)
    assert statuses == [200, 200, 200, 429, 429], statuses
    for st, h, body in answers:
        if st == 429:
            assert json.loads(body)["error"]["code"] == "rate_limited"
            assert int({k.lower(): v for k, v in h.items()}["retry-after"]) >= 1
    m = http("GET", base + "/metrics")[2].decode()
    assert metric(m, "splitserve_fleet_rate_limited_total", reason="queue_full") == 2


async def test_a_queued_request_times_out_with_429():
    from fleet.admission import RateLimiter
    from protocol.openai import ApiError
    rl = RateLimiter(rate=0.5, burst=1, max_queue=2, queue_timeout_s=0.1)
    await rl.admit()                      # the one token
    t = time.monotonic()
    with pytest.raises(ApiError) as ei:
        await rl.admit()                  # the next one is 2 s away: the 0.1 s wait runs out
    assert ei.value.status == 429 and ei.value.code == "rate_limited"
    assert "waited 0.1s" in ei.value.message
    assert time.monotonic() - t >= 0.1
    assert not rl.waiters or all(f.done() for f in rl.waiters)
    await asyncio.sleep(0)
