# One command builds the patched wheel, one runs the tests; both set themselves up.
# `make help` lists every target.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TOOLING := $(BIN)/tooling
STAMP := $(VENV)/.installed
DIST := dist
# Reproducible builds: the same commit gives the same wheel, byte for byte.
SOURCE_DATE_EPOCH ?= $(shell git log -1 --format=%ct 2>/dev/null || echo 315532800)
export SOURCE_DATE_EPOCH

.DEFAULT_GOAL := help
.PHONY: help wheel check test lint verify smoke status canary-docs reference-docs release check-patches clean probe-env

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check uv
	@# uv, given pip's index settings (stdlib only, so it runs before the install)
	$(BIN)/python -m tooling.pipsettings --quiet -e '.[dev]'
	$(BIN)/python -m compileall -q tooling
	touch $@

probe-env: $(STAMP) ## Create the cached CPU interpreter the behavioural probes run in
	@$(TOOLING) probe-env

# BASE=VERSION: another pinned base (a ported one builds only once the ledger decides every fix).
BASE ?=
wheel: $(STAMP) ## Build the patched vLLM CUDA wheel into dist/ (0.20.1, or BASE=VERSION)
	@$(TOOLING) probe-env >/dev/null
	$(TOOLING) build --dist $(DIST) $(if $(BASE),--base $(BASE))

# Two workers, each taking a whole test module (its module fixtures built once): most of
# the suite waits on child interpreters, so two overlap well even on two cores.
# TEST_WORKERS=0 runs them serially.
TEST_WORKERS ?= 2

check: $(STAMP) ## The fast tier: tests that need neither the real artifacts nor the probe env
	$(BIN)/pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadscope

test: $(STAMP) ## Run the test suite (fetches and caches the real vLLM artifacts)
	TOOLING_PROBE_PYTHON="$$($(TOOLING) probe-env)" \
	  TOOLING_DFLASH_PATH="$$($(TOOLING) probe-env --dflash-path)" \
	  $(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadscope

lint: $(STAMP) ## ruff, mypy, shellcheck, and the CI workflows (schema, zizmor offline)
	$(BIN)/ruff check tooling tests bench
	$(BIN)/ruff format --check tooling tests bench
	$(BIN)/mypy tooling
	$(BIN)/shellcheck --severity=warning tooling/release/bundle_files/install.sh ci/gpu/*.sh
	$(BIN)/check-jsonschema --builtin-schema vendor.github-workflows .github/workflows/*.yml
	$(BIN)/zizmor --offline --min-severity low .github/workflows/*.yml

check-patches: $(STAMP) ## Fail when patches/ is not what `tooling patch export` would write
	$(TOOLING) patch export --check

verify: $(STAMP) ## Install dist/'s wheel in a fresh virtualenv and verify it
	@$(TOOLING) probe-env >/dev/null
	@set -- $(DIST)/vllm-*.whl; [ -f "$$1" ] || { echo "error: no wheel in $(DIST)/ (run make wheel)" >&2; exit 2; }; \
	  [ $$# -eq 1 ] || { echo "error: several wheels in $(DIST)/: $$*" >&2; exit 2; }; \
	  $(TOOLING) verify --wheel "$$1"

status: $(STAMP) ## Status of every patch on every pinned release (the canary)
	@$(TOOLING) probe-env >/dev/null
	$(TOOLING) patch status --bases all

canary-docs: $(STAMP) ## docs/reference/canary.md from a fresh `patch status --bases all --json`
	@$(TOOLING) probe-env >/dev/null
	@mkdir -p build
	$(TOOLING) patch status --bases all --json > build/.canary-status.json
	mv build/.canary-status.json build/canary-status.json
	$(BIN)/python -m tooling.canary_doc build/canary-status.json -o docs/reference/canary.md

reference-docs: $(STAMP) ## docs/reference/cli.md from the Click commands and tooling/errors.py
	$(BIN)/python -m tooling.cli.reference -o docs/reference/cli.md

# The releases whose status goes into the release notes (the full matrix is `make status`).
RELEASE_STATUS_BASES ?= 0.20.1,0.22.0,0.26.0,0.33.0

release: wheel ## Wheel, SHA256SUMS, manifest, runtime lock and release notes in dist/
	$(TOOLING) patch status --bases $(RELEASE_STATUS_BASES) --json > $(DIST)/.status.json
	mv $(DIST)/.status.json $(DIST)/status.json
	$(TOOLING) bundle --wheel "$$(ls $(DIST)/vllm-*.whl)" --lock-only $(DIST)/vllm-runtime.lock
	$(TOOLING) release --dist $(DIST) --status-json $(DIST)/status.json \
	  --include $(DIST)/vllm-runtime.lock --include $(DIST)/status.json

smoke: $(STAMP) ## GPU smoke-serve of dist/'s wheel with a tiny model pair (needs an NVIDIA GPU)
	@command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 || \
	  { echo "error: make smoke needs an NVIDIA GPU host (nvidia-smi found none)" >&2; exit 2; }
	$(TOOLING) smoke --tiny --wheel "$$(ls $(DIST)/vllm-*.whl)"

clean: ## Remove build outputs (not the artifact cache)
	rm -rf build $(DIST) .pytest_cache
