#!/usr/bin/env bash
# What to run when a GPU machine is lent (issue 11): one table in a few minutes, printed to stdout.
#   bash bench/gpu.sh            # from the repository root or anywhere
# tokens/s and MFU of the paper-1b shape at bf16 on one GPU (grouped vs loop experts), and peak memory owning a
# quarter vs all experts (the paper reports ~35 vs ~55 GB); with 2 GPUs, a 2-process torchrun peer vs 1 process.
# Installs the project only if torch is missing (a machine without registry access needs torch preinstalled).
# Nothing is downloaded at run time: random tokens.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -c "import torch, transformers" 2>/dev/null; then
  pip install torch==2.13.0 && pip install -e .
fi
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible'; print(torch.__version__, torch.version.cuda, torch.cuda.device_count(), 'GPU(s):', torch.cuda.get_device_name(0))"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python -m bench.gpu --shape paper-1b --steps "${STEPS:-5}" --warmup 2
if [ "$(python -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  # One peer over 2 GPUs (torchrun, peer/ranks.py) vs one GPU: tokens/s and the speed-up.
  python -m bench.ranks --device cuda --shape paper-1b --nproc 2 --steps 30 --warmup 10 --rounds 1
fi
