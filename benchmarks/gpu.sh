#!/usr/bin/env bash
# The GPU's checks and figures in one command, on a machine with a CUDA GPU and attnlab installed
# (make install, or pip install -e '.[dev]' with a CUDA build of torch):
#
#   bash benchmarks/gpu.sh [OUT]        # OUT: where the JSON reports go (default benchmarks/results/gpu)
#
# 1. the card (nvidia-smi) and torch's view of it;
# 2. the CUDA tests: every test that a machine without a GPU skips (CUDA attention in half precision,
#    Llama and the Hugging Face families on the GPU, layers placed over the GPU and the CPU, ...);
# 3. `attnlab bench gpu`: attnlab against transformers and TransformerLens' bridge on Llama-shaped models with random weights in
#    bfloat16 (Llama 3.2 1B's shapes, and 3.1 8B's where the GPU has 40 GiB): forward, every-site cache,
#    importance, patching every head, greedy generation, and each task's peak GPU memory.
# Record the figures with the card in benchmarks/README.md ("gpu").
set -euo pipefail
OUT=${1:-benchmarks/results/gpu}
PYTHON=${PYTHON:-python}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/card.csv"
"$PYTHON" -c 'import torch; assert torch.cuda.is_available(), "torch sees no CUDA GPU"; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'
"$PYTHON" -m pytest -q -m "not slow" -rs -k "cuda or gpu or GPU" tests/unit tests/integration/test_cli_conventions.py \
    | tee "$OUT/cuda-tests.txt"
"$PYTHON" -m attnlab bench gpu --save "$OUT" | tee "$OUT/bench-gpu.txt"
