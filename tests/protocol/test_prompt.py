"""One prompt→token-ids recipe: every loader finds the chat template wherever a model directory
keeps it, and the fleet/coordinator recipe gives the ids the worker's own parser gives.

The three tokenizer loaders — `protocol.prompt.load_tokenizer` (fleet and coordinator), the sim
worker's (`worker.cli._sim_tokenizer`) and the torch worker's (`worker.loader.load_tokenizer`) —
read a real tokenizer.json and the template from `chat_template.jinja`, `chat_template.json` or
`tokenizer_config.json` (Hugging Face's precedence). Before the shared `chat_template_of`, the sim
worker's loader ignored `chat_template.json`.
"""
from __future__ import annotations

import json

import pytest

from protocol.prompt import chat_template_of, load_tokenizer, message_text, request_token_ids
from tests.fleet.routing_fixtures import OTHER_TEMPLATE, TEMPLATE, tokenizer_json
from worker import openai_api as wproto
from worker.cli import _sim_tokenizer
from worker.loader import load_tokenizer as torch_worker_tokenizer

CHAT = {"model": "m", "messages": [
    {"role": "system", "content": "you are a helpful assistant; answer briefly"},
    {"role": "user", "content": [{"type": "text", "text": "hello world"},
                                 {"type": "text", "text": "the quick brown fox"}]}]}
CMPL = {"model": "m", "prompt": "a shared system prompt for every turn"}


def _model_dir(tmp_path, where: str):
    d = tmp_path / where
    d.mkdir()
    (d / "tokenizer.json").write_text(tokenizer_json())
    cfg = {"bos_token": "<s>", "eos_token": "</s>"}
    if where == "tokenizer_config":
        cfg["chat_template"] = TEMPLATE
    elif where == "json":
        (d / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
        cfg["chat_template"] = OTHER_TEMPLATE      # the separate file wins
    else:
        (d / "chat_template.jinja").write_text(TEMPLATE)
        (d / "chat_template.json").write_text(json.dumps({"chat_template": OTHER_TEMPLATE}))
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "config.json").write_text(json.dumps({"vocab_size": 400, "max_position_embeddings": 4096}))
    return d


@pytest.mark.parametrize("where", ["jinja", "json", "tokenizer_config"])
def test_every_loader_finds_the_template_and_gives_the_same_ids(tmp_path, where):
    d = _model_dir(tmp_path, where)
    assert chat_template_of(d) == (None if where == "tokenizer_config" else TEMPLATE)
    toks = {"fleet/coordinator": load_tokenizer(str(d)), "sim worker": _sim_tokenizer(str(d))[0],
            "torch worker": torch_worker_tokenizer(d)}
    want_chat = request_token_ids(toks["fleet/coordinator"], CHAT, chat=True)
    want_cmpl = request_token_ids(toks["fleet/coordinator"], CMPL, chat=False)
    # the template that rendered is TEMPLATE's (the user turn is tagged [USER]), not the other one
    text = toks["fleet/coordinator"].decode(want_chat, skip_special_tokens=False)
    assert "[USER] hello world\nthe quick brown fox" in text and "[ASSISTANT]" in text
    for name, tok in toks.items():
        # the worker's own request parser, with that worker's tokenizer
        got_chat = wproto.parse_chat(dict(CHAT), tok, max_model_len=4096).prompt_token_ids
        got_cmpl = wproto.parse_completion(dict(CMPL), tok, max_model_len=4096).prompt_token_ids
        assert got_chat == want_chat, name
        assert got_cmpl == want_cmpl, name


def test_message_text_is_the_one_normalisation():
    assert message_text({"role": "user", "content": None}) == ""
    assert message_text({"role": "user", "content": "x"}) == "x"
    assert message_text({"role": "user", "content": [{"type": "text", "text": "a"},
                                                     {"type": "image_url", "image_url": {}},
                                                     {"type": "text", "text": "b"}]}) == "a\nb"
