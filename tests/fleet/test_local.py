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
