# Two set-up commands on a fresh machine: `make demo` and `make test`. Both create .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU build of torch on local disk; where it is absent pip takes the same pin from the index.
TORCH_PIN := torch==2.13.0
DEMO := build/demo

.PHONY: demo test venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$(TORCH_PIN)"
	$(BIN)/python -m pip install --quiet -e ".[hf,test]"
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest tests

demo: $(STAMP)
	$(BIN)/python examples/tiny_moe/train.py --out examples/tiny_moe --if-missing
	mkdir -p $(DEMO)
	$(BIN)/moeplan inspect examples/tiny_moe
	$(BIN)/moeplan trace examples/tiny_moe --data examples/tiny_moe/corpus_heldout.txt --out $(DEMO)/trace.npz
	$(BIN)/moeplan trace stats $(DEMO)/trace.npz

clean:
	rm -rf $(VENV) build
