"""Shared pieces of the routing end-to-end tests: a tiny Hugging Face-style model directory and a
fleet on an external coordinator, all real processes (tests/fleet/conftest.py)."""
from __future__ import annotations

import json
from pathlib import Path

from .conftest import free_port, group, healthy, http, wait_for

# A template unlike the presets' ChatML one, so a fleet that misses it tokenizes differently.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }} "
            "<|eot|>{% endfor %}{% if add_generation_prompt %}[ASSISTANT] {% endif %}")
OTHER_TEMPLATE = TEMPLATE.replace("[ASSISTANT]", "[BOT]")

_CORPUS = ["the quick brown fox jumps over the lazy dog", "a shared system prompt for every turn",
           "you are a helpful assistant; answer briefly", "hello world, hello there"] * 20


def tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<|eot|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok.to_str()


def model_dir(root: Path, name: str, template: str | None = TEMPLATE) -> Path:
    """A model directory whose chat template lives only in chat_template.jinja (newer HF layout)."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "tokenizer.json").write_text(tokenizer_json())
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (d / "config.json").write_text(json.dumps({"vocab_size": 400, "max_position_embeddings": 4096}))
    if template is not None:
        (d / "chat_template.jinja").write_text(template)
    return d


def coordinator_and_fleet(c, *, gen_urls, model="tiny", routing=None, router_args=None,
                          coordinator_extra=None):
    """An external coordinator process and a one-process fleet on it, both kv_cache_aware over
    `gen_urls` (an aggregated cluster: no context servers). → (fleet url, coordinator url, procs)."""
    doc = dict(model=str(model), generation_servers=group(gen_urls, "kv_cache_aware",
                                                         **(router_args or {})))
    if routing:
        doc["routing"] = routing
    cport = free_port()
    coord_doc = dict(doc, port=cport + 1,
                     coordinator={"health_check_interval_s": 0.3, **(coordinator_extra or {})})
    coord = c.coordinator(c.config(f"coord-{cport}.yaml", **coord_doc), cport)
    curl = f"http://127.0.0.1:{cport}"
    wait_for(lambda: http("GET", curl + "/health")[0] == 200, 60, "coordinator", coord)
    port = free_port()
    f = c.fleet(c.config(f"fleet-{port}.yaml", port=port, **doc), "--coordinator-url", curl,
                name=f"fleet-{port}")
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: healthy(url), 60, "fleet", f)
    return url, curl, coord, f


def post(url: str, path: str, body: dict):
    """→ (route receipt, worker usage, status)."""
    st, h, raw = http("POST", url + path, body, timeout=30)
    assert st == 200, (st, raw[:500])
    return json.loads(h["x-splitserve-route"]), json.loads(raw)["usage"]


def cluster_info(curl: str) -> dict:
    st, _, raw = http("GET", curl + "/cluster_info")
    assert st == 200
    return json.loads(raw)


def servers(info: dict) -> dict[str, dict]:
    return {s["url"]: s for role in info["servers"].values() for s in role}
