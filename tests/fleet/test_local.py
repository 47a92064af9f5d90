"""`splitserve local` (what `make serve` runs): up, answering, and fully stopped on SIGTERM."""
from __future__ import annotations

import json
import re
import signal

import openai
import pytest

from splitserve_testing.proctable import alive, children

from .conftest import PY, clean_env, free_port_pair, http, wait_for


# The torch engine's cluster is started (and stopped the same way) by
# tests/fleet/test_listen_addresses.py, which checks this test's stop and answers on it too.
@pytest.mark.parametrize("engine", ["sim"])
def test_local_cluster(cluster, engine):
    port = free_port_pair()
    p = cluster.spawn(f"local-{engine}", [PY, "-m", "splitserve_cli", "local", "--engine", engine,
                                          "--model", "tiny", "--port", str(port)], env=clean_env())
    wait_for(lambda: "splitserve is up" in p.log(), 120, "the local cluster", p)
    out = p.log()
    url = f"http://127.0.0.1:{port}"
    assert url in out and "curl -s" in out
    # the printed curl example is a valid request
    example = re.search(r"-d '(\{.*\})'", out).group(1)
    st, _, raw = http("POST", url + "/v1/chat/completions", json.loads(example))
    assert st == 200, raw
    r = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert r.usage.completion_tokens >= 1
    kids = children(p.pid)
    assert len(kids) == 3          # context worker, generation worker, fleet launcher
    p.kill(signal.SIGTERM)
    p.p.wait(60)
    assert p.p.returncode == 0, p.log()[-2000:]
    for k in kids:
        assert not alive(k)
    with pytest.raises(OSError):
        http("GET", url + "/health", timeout=1)


PROMPT = " ".join(f"word{i}" for i in range(300))


def _start_local(cluster, *extra):
    port = free_port_pair()
    p = cluster.spawn("local", [PY, "-m", "splitserve_cli", "local", "--engine", "sim", "--model", "tiny",
                                "--port", str(port), *extra], env=clean_env())
    wait_for(lambda: "splitserve is up" in p.log(), 120, "the local cluster", p)
    return p, f"http://127.0.0.1:{port}"


def _repeat(url: str, n: int, stream: bool = False) -> list[int]:
    """Send the same prompt `n` times; → the cached_tokens each answer reported."""
    cli = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    out = []
    for _ in range(n):
        if stream:
            usage = None
            for ch in cli.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                                  max_tokens=4, stream=True,
                                                  stream_options={"include_usage": True}):
                usage = ch.usage or usage
        else:
            usage = cli.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                                max_tokens=4).usage
        out.append(usage.prompt_tokens_details.cached_tokens)
    return out


def _no_prediction_alarm(url: str) -> None:
    # the coordinator judges its window once a second: give it two looks
    import time
    time.sleep(2.5)
    st, _, raw = http("GET", url + "/cluster_info")
    ci = json.loads(raw)
    assert ci["routing_diagnostics"]["prediction_alarm"] == [], ci["routing_diagnostics"]
    for s in ci["servers"]["generation"]:
        assert not (s["routing_prediction"] or {}).get("alarm"), s["routing_prediction"]


def test_local_quick_start_raises_no_kv_alarm_and_reports_the_context_cache(cluster):
    """Issue 39, item 2: `make serve`'s cluster, 10 identical requests. Generation is routed by
    load_balancing (the chart's choice: its KV arrives by transfer), nothing raises the
    predicted-vs-actual alarm, and clients see the context leg's cached tokens."""
    p, url = _start_local(cluster)
    # start-up progress (issue 39, item 7): each worker as it becomes ready, the config's path
    assert re.search(r"context worker ready on http://127\.0\.0\.1:\d+ \(\d+\.\ds\)", p.log()), p.log()
    assert "generation worker ready on" in p.log() and "cluster.yaml" in p.log()
    st, _, raw = http("GET", url + "/cluster_info")
    routers = json.loads(raw)["routers"]
    assert routers["generation"]["type"] == "load_balancing"
    assert routers["context"]["type"] == "kv_cache_aware"
    cached = _repeat(url, 5) + _repeat(url, 5, stream=True)
    assert cached[0] == 0
    assert all(c > 0 for c in cached[1:]), cached
    _no_prediction_alarm(url)
    assert "workers reported" not in p.log()


def test_generation_kv_routing_in_disaggregated_mode_raises_no_alarm(cluster):
    """The same with kv_cache_aware generation routing: the generation leg's report (no cached
    tokens: its KV arrived by transfer) is no predicted-vs-actual signal, so no alarm."""
    p, url = _start_local(cluster, "--generation-policy", "kv_cache_aware")
    _repeat(url, 10)
    _no_prediction_alarm(url)
