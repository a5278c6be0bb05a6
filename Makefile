# Two set-up commands on a fresh machine: `make demo` and `make test`. Both create .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU build of torch on local disk; where it is absent pip takes the same pin from the index.
TORCH_PIN := torch==2.13.0
# The MILP solver every plan goes through: another HiGHS release may take other branch-and-bound
# paths and give other plans, so a fresh machine pins the release the benchmarks here were run with.
HIGHS_PIN := highspy==1.16.0
# The library whose model code bundles run: a new release can rename what the runtime hooks into
# (5.24 passes the attention module its KV cache as `cache`, not `past_key_values`) or change what a
# model holds (5.24 keeps DeepSeek-V3's router weights in float32), so CI installs the release the
# suite was last run against; pyproject admits any 5.x for users, and plans record the one they used.
TRANSFORMERS_PIN := transformers==5.24.0
# SGLang's own EPLB and expert-location code, run by tests/test_engine_sglang_code.py; installed
# without dependencies (nothing imports the package; no CUDA pull). Its wheel is cp311/manylinux only.
SGLANG_PIN := sglang==0.5.23
# The engine targets' measured kernel tables (pyproject's `gpu` extra, pinned there): its wheel is cp311 abi3
# manylinux x86_64 only, so elsewhere the tests that need it skip and the roofline fallback is tested alone.
DEMO := build/demo
# Headless Chromium for tests/test_report_browser.py: Debian's package, driven by playwright (no browser
# download); installed with apt where missing when run as root (CI runs as root).
CHROMIUM := /usr/bin/chromium

.PHONY: demo test test-slow test-all venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	test -x $(CHROMIUM) || { test "$$(id -u)" = 0 && apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium fonts-dejavu-core; } \
		|| echo "note: no $(CHROMIUM); install Debian's chromium (as root: apt-get install chromium) for tests/test_report_browser.py"
	$(BIN)/python -m pip install --quiet "$(TORCH_PIN)" "$(HIGHS_PIN)" "$(TRANSFORMERS_PIN)"
	$(BIN)/python -m pip install --quiet -e ".[hf,test]"
	$(BIN)/python -m pip install --quiet -e ".[gpu]" || echo "note: no aiconfigurator-core wheel here; engine ops are priced by the roofline and tests/test_engine_cost.py skips its measured cases"
	$(BIN)/python -m pip install --quiet --no-deps "$(SGLANG_PIN)" || echo "note: no $(SGLANG_PIN) wheel here; tests/test_engine_sglang_code.py will skip"
	touch $(STAMP)

# `make test`: ruff, then every test but those marked slow (long end-to-end runs whose paths a test in
# `make test` also covers: README, Tests); under 10 minutes on a 2-core machine. `make test-slow`: the slow
# tier alone. `make test-all`: ruff, then every test. CI (.ci/run) runs `make test`, then `make test-slow`.
test: $(STAMP)
	$(BIN)/ruff check .
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest tests -m "not slow" -n 2 --dist loadfile

test-slow: $(STAMP)
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest tests -m slow -n 2 --dist loadfile

test-all: $(STAMP)
	$(BIN)/ruff check .
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest tests

# The demo prices its plan for this machine: `moeplan calibrate` measures it once (about two minutes) on the
# example model's own engine into build/demo/cpu-gloo.yaml, kept while it is this machine's calibration
# (--reuse: same machine key, runtime code included, same engine model), and compile reads it with --hardware.
demo: $(STAMP)
	$(BIN)/python examples/tiny_moe/train.py --out examples/tiny_moe --if-missing
	mkdir -p $(DEMO)
	$(BIN)/moeplan inspect examples/tiny_moe
	$(BIN)/moeplan trace examples/tiny_moe --data examples/tiny_moe/corpus_heldout.txt --out $(DEMO)/trace.npz
	$(BIN)/moeplan trace stats $(DEMO)/trace.npz
	$(BIN)/moeplan calibrate --model examples/tiny_moe --out $(DEMO)/cpu-gloo.yaml --reuse
	$(BIN)/moeplan compile examples/tiny_moe --trace $(DEMO)/trace.npz --target torchrun --nodes 2 --gpus-per-node 2 --policy ilp --time-limit 20 --hardware $(DEMO)/cpu-gloo.yaml --out $(DEMO)/bundle
	$(BIN)/moeplan run $(DEMO)/bundle --verify --nproc 4 --new-tokens 32 --mode both
	$(BIN)/python examples/serve_demo.py $(DEMO)/bundle

clean:
	rm -rf $(VENV) build
