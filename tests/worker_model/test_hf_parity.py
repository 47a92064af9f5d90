"""Logits equal Hugging Face transformers on tiny random checkpoints written with save_pretrained.

One transformers import for the whole module (it is slow); each case builds a 2-layer model."""
from __future__ import annotations

import inspect
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from protocol.tokenizer import ByteTokenizer, HFTokenizer  # noqa: E402
from worker.loader import LoaderError, load_model, load_tokenizer, save_hf_checkpoint  # noqa: E402
from worker.model_config import ModelConfigError  # noqa: E402
from worker.presets import build_preset  # noqa: E402
from worker.runner import Chunk, ModelRunner  # noqa: E402

BS = 4
REL = 1e-4
BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, rope_theta=10000.0, initializer_range=0.15)

CASES = {
    "llama-gqa-untied": ("LlamaForCausalLM", {}, 20),
    "llama-tied-llama3-rope": ("LlamaForCausalLM", dict(tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}), 40),
    "llama-linear-rope": ("LlamaForCausalLM", dict(rope_scaling={"rope_type": "linear", "factor": 2.5}), 20),
    # Prompt longer than max_position_embeddings: the NTK base is recomputed from the running length.
    "llama-dynamic-rope": ("LlamaForCausalLM", dict(max_position_embeddings=24, rope_scaling={
        "rope_type": "dynamic", "factor": 3.0}), 30),
    "llama-yarn-rope": ("LlamaForCausalLM", dict(max_position_embeddings=128, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}), 40),
    "llama-mha-explicit-head-dim": ("LlamaForCausalLM", dict(num_key_value_heads=4, head_dim=24), 20),
    "mistral-sliding-window": ("MistralForCausalLM", dict(sliding_window=7), 30),
    "qwen2-qkv-bias": ("Qwen2ForCausalLM", {}, 20),
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def write_checkpoint(tmp_path, arch, overrides, shard=False):
    cls = getattr(transformers, arch)
    cfg_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    torch.manual_seed(0)
    hf = cls(cfg_cls(**{**BASE, **overrides})).eval()
    out = tmp_path / arch
    hf.save_pretrained(out, max_shard_size="60KB" if shard else "5GB")
    return hf, out


def hf_incremental(hf, tokens, prefill):
    """Logits of the last prompt token and of each later token fed one at a time through HF's cache."""
    # transformers 5.x renames past_key_values → cache (the old name is deprecated).
    cache_kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = hf(torch.tensor([tokens[:prefill]]), use_cache=True)
        logits = [out.logits[0, -1]]
        pkv = out.past_key_values
        for t in tokens[prefill:]:
            out = hf(torch.tensor([[t]]), use_cache=True, **{cache_kw: pkv})
            pkv = out.past_key_values
            logits.append(out.logits[0, -1])
    return torch.stack(logits)


def ours_incremental(runner, tokens, prefill):
    blocks = list(range((len(tokens) + BS - 1) // BS))
    logits = [runner.step([Chunk(tokens[:prefill], 0, blocks)])[0]]
    for p in range(prefill, len(tokens)):
        logits.append(runner.step([Chunk([tokens[p]], p, blocks)])[0])
    return torch.stack(logits)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case):
    arch, overrides, prompt_len = CASES[case]
    hf, path = write_checkpoint(tmp_path, arch, overrides, shard=case == "llama-gqa-untied")
    if case == "llama-gqa-untied":
        assert (path / "model.safetensors.index.json").is_file()  # sharded load path exercised
    model, tok, cfg = load_model(path, "cpu", "float32")
    assert isinstance(tok, ByteTokenizer)  # no tokenizer.json: byte-level stand-in
    assert cfg.tie_word_embeddings == bool(overrides.get("tie_word_embeddings", False))
    if cfg.tie_word_embeddings:
        assert model.lm_head is None
    tokens = [(i * 53 + 7) % 300 for i in range(prompt_len + 6)]
    ref = hf_incremental(hf, tokens, prompt_len)
    got = ours_incremental(ModelRunner(model, num_blocks=32, block_size=BS), tokens, prompt_len)
    assert rel_err(got, ref) <= REL, case
    if "dynamic" not in case:  # one forward over everything agrees with the cached path
        with torch.no_grad():
            full = hf(torch.tensor([tokens])).logits[0, prompt_len - 1:]
        assert rel_err(got, full) <= REL


def test_window_and_scaling_are_not_ignored(tmp_path):
    """The parity cases would be vacuous if the options did nothing at these lengths."""
    tokens = [(i * 53 + 7) % 300 for i in range(30)]

    def last_logits(arch, overrides):
        hf, _ = write_checkpoint(tmp_path, arch, overrides)
        with torch.no_grad():
            return hf(torch.tensor([tokens])).logits[0, -1]

    plain = last_logits("MistralForCausalLM", dict(sliding_window=None))
    assert rel_err(last_logits("MistralForCausalLM", dict(sliding_window=7)), plain) > 1e-2
    base = last_logits("LlamaForCausalLM", {})
    for case in ("llama-yarn-rope", "llama-linear-rope", "llama-tied-llama3-rope"):
        arch, overrides, _ = CASES[case]
        assert rel_err(last_logits(arch, {**overrides, "tie_word_embeddings": False}), base) > 1e-3, case


def test_exported_preset_loads_in_transformers(tmp_path):
    ours = build_preset("tiny")
    path = save_hf_checkpoint(ours, tmp_path / "tiny")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = ByteTokenizer().encode("hello, paged world")
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0, -1]
    got = ModelRunner(ours, num_blocks=8, block_size=BS).step([Chunk(tokens, 0, list(range(5)))])[0]
    assert rel_err(got, ref) <= REL
    reloaded, _, cfg = load_model(path, "cpu", "float32")
    for (n, a), (_, b) in zip(ours.named_parameters(), reloaded.named_parameters()):
        assert torch.equal(a, b), n


def test_loader_errors(tmp_path):
    _, path = write_checkpoint(tmp_path, "LlamaForCausalLM", {})
    from safetensors.torch import load_file, save_file
    weights = load_file(path / "model.safetensors")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((path / "config.json").read_text())
    missing = {k: v for k, v in weights.items() if "layers.1.mlp.up_proj" not in k}
    save_file(missing, broken / "model.safetensors")
    with pytest.raises(LoaderError, match=r"missing weights for \['layers.1.mlp.gate_up_proj.weight'\]"):
        load_model(broken)
    save_file({**weights, "model.extra.weight": torch.zeros(1)}, broken / "model.safetensors")
    with pytest.raises(LoaderError, match="unexpected tensors.*model.extra.weight"):
        load_model(broken)
    bad = dict(weights)
    bad["model.norm.weight"] = torch.zeros(65)
    save_file(bad, broken / "model.safetensors")
    with pytest.raises(LoaderError, match=r"model.norm.weight has shape \(65,\).*\(64,\)"):
        load_model(broken)
    (broken / "model.safetensors").unlink()
    (broken / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(LoaderError, match="pickled weights are not loaded"):
        load_model(broken)
    cfg = json.loads((path / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt_neox"}))
    with pytest.raises(ModelConfigError, match="gpt_neox"):
        load_model(broken)
    with pytest.raises(LoaderError, match="neither a preset"):
        load_model(tmp_path / "nope")
    with pytest.raises(LoaderError, match="dtype must be one of"):
        load_model("tiny", "cpu", "int8")


# ----------------------------------------------------------------------------- tokenizer files

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# Indented blocks: output depends on trim_blocks/lstrip_blocks being set as transformers sets them.
INDENTED_TEMPLATE = """{%- for message in messages %}
    {%- if message['role'] == 'system' %}
<<SYS>>{{ message['content'] }}<</SYS>>
    {% else %}
[{{ message['role'] | upper }}] {{ message['content'] }}
    {% endif %}
{%- endfor %}
{%- if add_generation_prompt %}[ASSISTANT]{% endif %}"""


def _word_tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok.train_from_iterator(["hello there general kenobi", "you are a helpful assistant"] * 10,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)])
    return tok.to_str()


@pytest.mark.parametrize("template", [LLAMA3_TEMPLATE, INDENTED_TEMPLATE])
def test_chat_template_renders_like_transformers(template):
    from tokenizers import Tokenizer
    tj = _word_tokenizer_json()
    cfg = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "chat_template": template}
    ref = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tj), **cfg)
    ours = HFTokenizer.from_json(tj, cfg)
    messages = [{"role": "system", "content": "  You are a helpful assistant. "},
                {"role": "user", "content": "hello there"}, {"role": "assistant", "content": "general kenobi"},
                {"role": "user", "content": "héllo ✓"}]
    for gen in (True, False):
        want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(messages, add_generation_prompt=gen) == want
        text = ours.apply_chat_template(messages, add_generation_prompt=gen)
        assert ours.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False)["input_ids"]
    assert ours.encode("hello there") == ref("hello there")["input_ids"]


def test_tokenizer_directory_files(tmp_path):
    (tmp_path / "tokenizer.json").write_text(_word_tokenizer_json())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<|begin_of_text|>"}, "eos_token": "<|end_of_text|>",
        "chat_template": "IGNORED"}))
    (tmp_path / "chat_template.jinja").write_text(LLAMA3_TEMPLATE)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 4]}))
    tok = load_tokenizer(tmp_path)
    assert tok.bos_token_id == 0 and tok.eos_token_ids == (1, 4)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]).startswith("<|begin_of_text|><|start_header_id|>user")
