# Two commands on a fresh machine:  `make demo`  and  `make test`.
# Both create .venv if it is absent and reuse it afterwards; the install step reruns
# only when pyproject.toml, setup.py or csrc/ change.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
INSTALL_INPUTS := pyproject.toml setup.py Makefile $(shell find csrc -type f 2>/dev/null)
# torch/torchvision pins come from pyproject.toml (one place), installed before the
# project so that csrc/ builds against them without build isolation.
TORCH_PINS := $(shell grep -oE '"torch(vision)?==[^"]+"' pyproject.toml | tr -d '"')
TINY := -c configs/pipeline.yaml -c configs/presets/tiny.yaml

.PHONY: install demo test gate clean slurm

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip "setuptools>=77" wheel

# nuscenes-devkit (nuScenes converter, detection-metric oracle) pins numpy<2 but runs on
# numpy 2: it is installed without its pins; the dev extra lists what its code imports.
$(STAMP): $(BIN)/python $(INSTALL_INPUTS)
	$(BIN)/pip install --quiet $(TORCH_PINS)
	MAX_JOBS=2 $(BIN)/pip install --quiet --no-build-isolation -e ".[dev]"
	$(BIN)/pip install --quiet --no-deps nuscenes-devkit==1.2.0
	touch $@

install: $(STAMP)

demo: install
	$(BIN)/stack config $(TINY)
	$(BIN)/stack data make $(TINY)
	$(BIN)/stack train $(TINY) train.overwrite=true
	$(BIN)/stack eval runs/tiny/train/model.pt $(TINY); rc=$$?; \
		if [ $$rc -eq 1 ]; then echo "stack eval: a head is below its bar (table above); the demo goes on"; \
		elif [ $$rc -ne 0 ]; then exit $$rc; fi
	$(BIN)/stack deploy --target orin $(GATE_CKPT) $(TINY)
	$(BIN)/stack deploy --target cpu $(GATE_CKPT) $(TINY)

test: install slurm
	$(BIN)/python -m pytest
	$(MAKE) --no-print-directory gate

# The FPS gate that `make test` (so CI) ends with: ci-cpu measured with ONNX Runtime, orin
# predicted by the latency model, both on the tiny preset's trained model: the one `make demo`
# trains when it exists, otherwise a short training run of the same network made here
# (CI_CKPT, 60 steps; the gate measures the network, which training length does not change).
GATE_CKPT := runs/tiny/train/model.pt
CI_CKPT := runs/tiny-ci/train/model.pt
gate: install
	@ckpt=$(GATE_CKPT); \
	if [ ! -f $$ckpt ]; then \
		ckpt=$(CI_CKPT); \
		test -f $$ckpt || { $(BIN)/stack data make $(TINY) && \
			$(BIN)/stack train $(TINY) train.out_dir=runs/tiny-ci/train train.max_steps=60 train.overwrite=true; } || exit 1; \
	fi; \
	echo "FPS gate on $$ckpt"; \
	$(BIN)/stack deploy --target ci-cpu $$ckpt $(TINY) && $(BIN)/stack deploy --target orin $$ckpt $(TINY)

# SLURM + munge for the trainer's one-node cluster test (Debian packages; installed once).
slurm:
	@if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge; \
	fi

clean:
	rm -rf build *.egg-info runs
