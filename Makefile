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
# pytest workers (pytest-xdist), one per core: most tests keep one core busy. A test file stays on one worker
# (--dist loadfile: its module fixtures are built once); tests that judge measured time or start the one-node
# SLURM cluster are marked `serial` (@pytest.mark.serial) and run alone afterwards.
TEST_WORKERS ?= $(shell nproc)

.PHONY: install demo drive-recipe test test-portable recipe gate clean slurm perf valgrind

# A full disk fails pip or a test far into the run with a bare OSError: say so before starting.
# $(1) folder, $(2) GiB it needs, $(3) what for. Exit 2: the machine, not the code, is short.
define require_free_gib
	@avail=$$(df -Pk "$(1)" | awk 'NR==2 {print int($$4 / 1048576)}'); \
	if [ "$$avail" -lt $(2) ]; then \
		echo "make: $(3) needs about $(2) GiB free on the filesystem of $(1); found $$avail GiB." \
			"Free space there (old clones and their .venv, runs/, /tmp/pytest-of-$$(id -un)) and run make again." >&2; \
		exit 2; fi
endef

$(BIN)/python:
	$(call require_free_gib,.,10,the Python environment (torch and its CUDA libraries: 7.3 GiB installed))
	$(call require_free_gib,$${TMPDIR:-/tmp},3,pip's unpacked wheels)
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

# The tiny recipe end to end: render, train, evaluate, deploy for two targets, then DAgger (the trained network
# drives training episodes, the privileged expert labels what it visits, it is fine-tuned: 3 iterations, ~5 min)
# and the network before and after DAgger driven side by side with the deployed bundle, with clips of each one's
# worst episodes.
DAGGER_MODEL := runs/tiny/dagger/model.pt
demo: install
	$(BIN)/stack config $(TINY)
	$(BIN)/stack data make $(TINY)
	$(BIN)/stack train $(TINY) train.overwrite=true
	$(BIN)/stack eval runs/tiny/train/model.pt $(TINY); rc=$$?; \
		if [ $$rc -eq 1 ]; then echo "stack eval: a head is below its bar (table above); the demo goes on"; \
		elif [ $$rc -ne 0 ]; then exit $$rc; fi
	for target in orin cpu; do $(BIN)/stack deploy --target $$target $(RECIPE_MODEL) $(TINY) \
		targets.$$target.closed_loop.episodes=$(RECIPE_EPISODES); rc=$$?; \
		if [ $$rc -eq 1 ]; then echo "stack deploy --target $$target: a gate failed (report above); the demo goes on"; \
		elif [ $$rc -ne 0 ]; then exit $$rc; fi; done
	$(BIN)/stack dagger $(RECIPE_MODEL) $(TINY) dagger.overwrite=true
	$(BIN)/stack drive $(RECIPE_MODEL) $(DAGGER_MODEL) runs/tiny/export/cpu $(TINY) --episodes 14 drive.seeds=[0,1] \
		drive.out_dir=runs/tiny/drive; rc=$$?; \
		if [ $$rc -eq 1 ]; then echo "stack drive: a network is below the closed-loop bar (drive.md above)"; \
		elif [ $$rc -ne 0 ]; then exit $$rc; fi
	@echo "the network before and after DAgger (runs/tiny/dagger/dagger.png), driven side by side: runs/tiny/drive/drive.md;"
	@echo "MP4 clips of each one's worst episodes: runs/tiny/drive/clips/"

# The network that drives (BENCHMARKS.md, closed loop, "DAgger on the guarded preset network"): the tiny-drive
# preset's data (the recorded scenes + 84 noisy-expert closed-loop episodes), its network trained 4104 steps (~38 min
# on 2 idle AVX-512 cores in bf16; CPUs without bf16 train in fp32, slower), 3 DAgger iterations from it (~8 min),
# then both driven on 112 held-out episodes beside the expert and the blind policies, with clips of each one's worst
# episodes and its best of every family. `stack drive` exits 1 when a network misses the closed-loop bar. Not part of
# `make test`: it takes longer than the whole test budget.
TINY_DRIVE := $(TINY) -c configs/presets/tiny-drive.yaml
drive-recipe: install
	$(BIN)/stack data make $(TINY_DRIVE)
	$(BIN)/stack train $(TINY_DRIVE) train.overwrite=true
	$(BIN)/stack dagger runs/tiny-drive/train/model.pt $(TINY_DRIVE) dagger.overwrite=true
	$(BIN)/stack drive runs/tiny-drive/train/model.pt runs/tiny-drive/dagger/model.pt $(TINY_DRIVE) --episodes 112 \
		"drive.seeds=[0,1,2,3,4,5]" drive.best_clips=1

# pytest (its 30 slowest tests listed at the end, where the time budget goes), the instruction-count check, the world, rendering, metrics and closed-loop tests again as other
# CPUs compute, then the tiny recipe end to end on the model it trains: a head below its `stack eval` bar,
# a kernel or renderer stage that executes more instructions than its baseline allows, or a failed deploy
# gate fails `make test` (so CI). Each phase prints its wall time (bash's `time`: the 45-minute budget is kept
# phase by phase), and each pytest phase writes JUnit XML with every test's time to $(TEST_REPORTS).
TEST_REPORTS := runs/test-reports
test: install slurm valgrind
	$(call require_free_gib,.,2,the recipe's shards and checkpoints and bundles under runs/)
	$(call require_free_gib,$${TMPDIR:-/tmp},3,pytest's temporary folders and torch's compile cache)
	time $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not serial" --durations=30 \
		--junitxml=$(TEST_REPORTS)/parallel.xml
	time $(BIN)/python -m pytest -m serial --durations=10 --junitxml=$(TEST_REPORTS)/serial.xml
	time $(MAKE) --no-print-directory perf
	time $(MAKE) --no-print-directory test-portable PORTABLE_CPUS=avx2
	time $(MAKE) --no-print-directory recipe

# The CPU kernels (stack._C) and one renderer frame under valgrind's callgrind, one thread, instructions and
# simulated cache misses per stage against benchmarks/instructions/<level>.json (stack/instructions/):
# +3% instructions in a stage or a kernel function fails, naming the function that grew. 35-57 s.
perf: install valgrind
	$(BIN)/stack bench instructions --check

# The tests whose results depend on the SIMD kernels numpy and PyTorch pick (world generation,
# rendering, datasets, metrics, the closed loop), run as an AVX2-only CPU and as an SSE4.2 one would
# (`pytest --emulate-cpu`, tests/conftest.py): a result pinned to this CPU's kernels fails here,
# whatever CPU CI has that day. A CPU with nothing above a level skips it: the plain run was that run.
# `make test` runs the avx2 level only (the slowest CPU CI gets: there it adds nothing to the budget).
# The folders are those that exist (the simulator's tests may move). They hold no `serial` test, so they run on
# every core as the parallel part does (the emulation's environment reaches pytest-xdist's workers).
PORTABLE_TESTS := $(wildcard tests/data tests/sim tests/stack/metrics)
PORTABLE_CPUS ?= avx2 x86-64-v2
test-portable: install
	@for cpu in $(PORTABLE_CPUS); do \
		$(BIN)/python -m stack.testing above $$cpu; rc=$$?; \
		if [ $$rc -eq 0 ]; then $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile \
			--junitxml=$(TEST_REPORTS)/portable-$$cpu.xml --emulate-cpu=$$cpu $(PORTABLE_TESTS) || exit 1; \
		elif [ $$rc -ne 1 ]; then exit $$rc; fi; \
	done

# The recipe's outputs are make targets under runs/tiny whose prerequisites are the configs and
# the sources that shape them: a second `make test` renders and trains again only when one of
# those changed (CI runs in a clean clone, so it always renders and trains: ~2 + ~12 min on 2 cores).
RECIPE_DATA := runs/tiny/data/manifest.json
RECIPE_MODEL := runs/tiny/train/model.pt
TINY_CONFIGS := configs/pipeline.yaml configs/presets/tiny.yaml
DATA_SOURCES := $(TINY_CONFIGS) $(wildcard stack/*.py stack/pipeline/*.py) $(shell find sim data -name '*.py' 2>/dev/null)
TRAIN_SOURCES := $(DATA_SOURCES) $(shell find models train stack/ops stack/metrics csrc -type f \
	\( -name '*.py' -o -name '*.cpp' -o -name '*.cu' -o -name '*.h' \) 2>/dev/null)

$(RECIPE_DATA): $(DATA_SOURCES) | $(STAMP)
	$(BIN)/stack data make $(TINY)
	touch $@

$(RECIPE_MODEL): $(RECIPE_DATA) $(TRAIN_SOURCES) | $(STAMP)
	$(BIN)/stack train $(TINY) train.overwrite=true

recipe: $(RECIPE_MODEL)
	$(BIN)/stack eval $(RECIPE_MODEL) $(TINY)
	$(MAKE) --no-print-directory gate

# The deploy gates on the recipe's model: ci-cpu measured with ONNX Runtime, orin predicted by
# the latency model. The recipe's network clears every head bar but does not yet drive better than
# the blind ego-status rollout (BENCHMARKS, closed loop), so the quality gate says it is not worth
# shipping: its bundles are built with --allow-below-bar and marked NOT FOR DEPLOYMENT, and every other
# gate (parity, INT8 accuracy and closed loop against fp32, FPS) must pass or `make test` fails.
# An INT8 head whose drop is within budget but whose interval over the 10 validation scenes reaches past it is
# inconclusive, which fails a target by default: ci-cpu then ships fp32; orin (TensorRT ships the INT8 graph) is
# told to accept it here, for this experiment-grade bundle only (the recipe's orin detection drop measured
# +0.0186 [+0.0116, +0.0256] against 0.02 on an AVX2 EPYC; BENCHMARKS, deploy gates).
# The recipe's closed-loop gates drive RECIPE_EPISODES, not the targets' derived 77 (90% power to catch a drop of
# 0.08): 28 keep `make test` in its budget on 2 cores and give 55% power, which each report states; a bundle
# meant for a car drives the target's own count.
RECIPE_EPISODES := 28
gate: $(RECIPE_MODEL)
	$(BIN)/stack deploy --target ci-cpu --allow-below-bar $(RECIPE_MODEL) $(TINY) \
		targets.ci-cpu.closed_loop.episodes=$(RECIPE_EPISODES)
	$(BIN)/stack deploy --target orin --allow-below-bar $(RECIPE_MODEL) $(TINY) targets.orin.accuracy_inconclusive_passes=true \
		targets.orin.closed_loop.episodes=$(RECIPE_EPISODES)
	-$(BIN)/stack runs $(TINY)  # the tracked runs (MLflow, runs/tiny/mlruns.db) with their eval and deploy verdicts

# SLURM + munge for the trainer's one-node cluster test (Debian packages; installed once).
slurm:
	@if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge; \
	fi

# valgrind with its client-request headers (Debian's `valgrind` package), for `make perf`; installed once.
valgrind:
	@if ! command -v valgrind >/dev/null || [ ! -f /usr/include/valgrind/callgrind.h ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind; \
	fi

clean:
	rm -rf build *.egg-info runs
