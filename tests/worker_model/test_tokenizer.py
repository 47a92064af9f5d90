"""protocol.tokenizer: byte and Hugging Face tokenizers, chat templates, streaming detokenization."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from protocol.tokenizer import (DEFAULT_CHAT_TEMPLATE, ByteTokenizer, ChatTemplateError, DetokenizeState,
                              HFTokenizer, TokenizerError, decode_stream, render_chat_template)

MULTI = "naïve café — 世界 🎉🇫🇷 ok"
CORPUS = [
    "the quick brown fox jumps over the lazy dog", "hello world, hello there", "naïve café déjà vu",
    "世界你好 世界", "emoji 🎉 party 🎉🎉", "streaming tokens one by one", "the world is wide",
] * 20


def _bpe_json(kind: str) -> str:
    """A small trained tokenizer serialized to tokenizer.json text: GPT-2 style byte-level BPE or a
    SentencePiece-style Metaspace BPE (word-boundary spaces as ▁, byte fallback)."""
    if kind == "bytelevel":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<|eot|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<|eot|>"])
    tok.train_from_iterator(CORPUS, trainer)
    if kind != "bytelevel":
        # Byte-fallback pieces are ordinary vocabulary entries in SentencePiece models (not specials).
        spec = json.loads(tok.to_str())
        vocab = spec["model"]["vocab"]
        for i in range(256):
            vocab.setdefault(f"<0x{i:02X}>", len(vocab))
        tok = Tokenizer.from_str(json.dumps(spec))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok.to_str()


@pytest.fixture(scope="module", params=["bytelevel", "metaspace"])
def hf(request):
    cfg = {"bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>",
           "chat_template": [{"name": "tool_use", "template": "TOOLS"},
                             {"name": "default", "template": DEFAULT_CHAT_TEMPLATE}]}
    tok = HFTokenizer.from_json(_bpe_json(request.param), cfg, extra_eos_token_ids=[3])
    tok.kind = request.param
    return tok


def stream(tok, ids, prompt_ids=None):
    state = DetokenizeState(tok, prompt_ids=prompt_ids)
    deltas = [state.push(i) for i in ids]
    deltas.append(state.flush())
    return deltas, state


# ----------------------------------------------------------------------------- byte tokenizer


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_round_trip_any_text(text):
    tok = ByteTokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode(text)[0] == tok.bos_token_id


def test_byte_specials():
    tok = ByteTokenizer(vocab_size=300)
    ids = tok.encode("<|im_start|>hi<|im_end|>", add_special_tokens=False)
    assert ids == [259, ord("h"), ord("i"), 260]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"
    assert tok.eos_token_ids == (257, 260) and tok.bos_token_id == 256 and tok.eos_token_id == 257
    assert tok.decode([299, ord("a")]) == "a"  # unused ids of a padded vocabulary decode to nothing
    with pytest.raises(TokenizerError, match=r"\[0, 300\)"):
        tok.decode([300])
    with pytest.raises(TokenizerError, match="vocab_size >= 261"):
        ByteTokenizer(vocab_size=100)
    with pytest.raises(TokenizerError, match="expects str"):
        tok.encode(b"bytes")


@settings(max_examples=100, deadline=None)
@given(st.text(min_size=1).filter(lambda t: "\ufffd" not in t))
def test_byte_stream_never_splits_characters(text):
    tok = ByteTokenizer()
    deltas, state = stream(tok, list(text.encode()))
    assert "".join(deltas) == text == state.text
    assert all("\ufffd" not in d for d in deltas)


def test_byte_stream_holds_back_partial_characters():
    tok = ByteTokenizer()
    euro = "€".encode()  # 3 bytes
    state = DetokenizeState(tok)
    assert state.push(ord("a")) == "a"
    assert state.push(euro[0]) == ""
    assert state.push(euro[1]) == ""
    assert state.push(euro[2]) == "€"
    # Invalid bytes surface as U+FFFD once followed by something decodable; a dangling lead byte at the
    # end is flushed as U+FFFD too.
    assert state.push(0xFF) == ""
    assert state.push(ord("b")) == "\ufffdb"
    assert state.push(0xE4) == ""
    assert state.flush() == "\ufffd"
    assert state.text == "a€\ufffdb\ufffd"
    assert list(decode_stream(tok, list("ok 🎉".encode()))) == ["o", "k", " ", "🎉"]


# ----------------------------------------------------------------------------- HF tokenizers


def test_hf_round_trip_and_specials(hf):
    ids = hf.encode(MULTI)
    assert ids[0] == hf.bos_token_id == 1 - (hf.kind == "bytelevel")
    assert hf.encode(MULTI, add_special_tokens=False) == ids[1:]
    assert hf.decode(ids) == MULTI
    assert hf.eos_token_ids == (hf.backend.token_to_id("</s>"), 3)
    with pytest.raises(TokenizerError, match="token id"):
        hf.decode([hf.vocab_size])


def test_hf_stream_matches_full_decode(hf):
    text = "hello world 世界 naïve 🎉 日本 ☃ emoji party the end"  # 日本 ☃: unseen in training → byte tokens
    ids = hf.encode(text, add_special_tokens=False)
    # Multi-byte characters really are split across tokens in this vocabulary.
    assert any("\ufffd" in hf.decode([i]) for i in ids)
    deltas, state = stream(hf, ids)
    assert "".join(deltas) == text == state.text
    assert all("\ufffd" not in d for d in deltas)


def test_hf_stream_keeps_word_spacing_after_prompt(hf):
    prompt = hf.encode("the quick brown")
    gen = hf.encode(" fox jumps over the lazy dog", add_special_tokens=False)
    deltas, _ = stream(hf, gen, prompt_ids=prompt)
    full = hf.decode(prompt + gen)
    assert "".join(deltas) == full[len(hf.decode(prompt)):] == " fox jumps over the lazy dog"
    if hf.kind == "metaspace":  # the decoder strips a leading ▁: context is what keeps the space
        assert "".join(stream(hf, gen)[0]) == "fox jumps over the lazy dog"


def test_hf_missing_eos_in_vocab_is_an_error():
    with pytest.raises(TokenizerError, match="not in the vocabulary"):
        HFTokenizer.from_json(_bpe_json("bytelevel"), {"eos_token": "<nope>"})
    with pytest.raises(TokenizerError, match="could not be parsed"):
        HFTokenizer.from_json("{not json", {})


# ----------------------------------------------------------------------------- chat templates


MESSAGES = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]


def test_default_template_renders_chatml():
    tok = ByteTokenizer()
    text = tok.apply_chat_template(MESSAGES)
    assert text == ("<|begin_of_text|><|im_start|>system\nbe brief<|im_end|>\n"
                    "<|im_start|>user\nhi\nthere<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[:2] == [256, 259] and ids.count(260) == 2
    assert not tok.apply_chat_template(MESSAGES, add_generation_prompt=False).endswith("assistant\n")


def test_named_template_list_picks_default(hf):
    assert hf.apply_chat_template(MESSAGES).startswith("<s><|im_start|>system")


def test_template_features_and_errors():
    tpl = ("{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
           "{{ m.content | tojson }}{% if loop.last %}{% break %}{% endif %}{% endfor %}"
           "{{ tools | length if tools else '' }}")
    out = render_chat_template(tpl, [{"role": "user", "content": "é\"x"}], tools=[{"a": 1}])
    assert out == json.dumps("é\"x", ensure_ascii=False) + "1"
    with pytest.raises(ChatTemplateError, match="no bad roles"):
        render_chat_template(tpl, [{"role": "bad", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat_template("{% for %}", MESSAGES)
    with pytest.raises(ChatTemplateError, match="non-empty list"):
        render_chat_template(tpl, [])
    with pytest.raises(ChatTemplateError, match=r"messages\[0\].role"):
        render_chat_template(tpl, [{"content": "x"}])
    with pytest.raises(ChatTemplateError, match="text part"):
        render_chat_template(tpl, [{"role": "user", "content": [{"type": "image_url"}]}])
    # The sandbox refuses attribute escapes.
    with pytest.raises(ChatTemplateError):
        render_chat_template("{{ messages.__class__.__mro__[1].__subclasses__() }}", MESSAGES)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        HFTokenizer.from_json(_bpe_json("bytelevel"), {}).apply_chat_template(MESSAGES)
