# specmesh — set-up, serve, test, bench, models. Every target installs what it needs first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
HOST   ?= 127.0.0.1
PORT   ?= 50051
LIMIT  ?= 20
TOKENS ?= 128

.PHONY: setup serve test bench models model-target model-draft model-cards protos clean-venv

setup: $(STAMP)

# torch is pinned to the CPU wheel first so no multi-GB CUDA build is pulled on a CPU machine.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	rm -f $(VENV)/.installed-* && touch $(STAMP)

serve: setup
	$(BIN)/specmesh serve --host $(HOST) --port $(PORT)

test: setup
	$(BIN)/python -m pytest -q tests

bench: setup
	$(BIN)/specmesh bench --workload humaneval --methods vanilla,sd,hf-vanilla,hf-assisted,hf-pld \
	    --limit $(LIMIT) --max-new-tokens $(TOKENS) --out bench/results/humaneval.json
	$(BIN)/specmesh bench --workload stdlib-heldout --methods vanilla,sd,hf-vanilla,hf-assisted,hf-pld \
	    --limit $(LIMIT) --max-new-tokens $(TOKENS) --out bench/results/stdlib-heldout.json
	$(BIN)/specmesh bench --workload edit --methods vanilla,sd,hf-vanilla,hf-assisted,hf-pld \
	    --limit $(LIMIT) --max-new-tokens 256 --out bench/results/edit.json

# Regenerates the whole zoo deterministically (seeded); resumable: rerun after an interruption.
models: setup
	$(BIN)/python -m training.tokenizer --out models/tokenizer
	$(MAKE) model-target model-draft model-cards

model-target: setup
	$(BIN)/python -m training.pretrain --preset target --out models/target

model-draft: setup
	$(BIN)/python -m training.pretrain --preset draft --out models/draft

model-cards: setup
	$(BIN)/python -m training.evaluate --model models/target
	$(BIN)/python -m training.evaluate --model models/draft

protos: setup
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. \
	    protos/specmesh/v1/generate.proto

clean-venv:
	rm -rf $(VENV)
