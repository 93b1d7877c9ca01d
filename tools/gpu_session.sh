#!/usr/bin/env bash
# The GPU checks as one short script, for a session lent a GPU machine (the `device` tool runs it in the
# repository root; what lands under $OUT comes back). About 6 minutes on an H100 (each step has its own limit); give it timeout_s 540.
#
#   bash tools/gpu_session.sh
#
# 1. the GPU tier (tests/gpu: NCCL against torch's DDP, autocast, GradScaler, SyncBatchNorm, fit);
# 2. the CUDA half of the engine's own cost (benchmarks/engine_overhead.py, no-op group, world 8);
set -u
OUT="${OUT:-/tmp/gpu_out}"
mkdir -p "$OUT"
export PYTHONPATH=src OMP_NUM_THREADS=4
python -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee "$OUT/device.txt"
timeout 200 python -m pytest -q -p no:cacheprovider tests/gpu > "$OUT/gpu_tier.txt" 2>&1
echo "gpu tier exit $?" >> "$OUT/gpu_tier.txt"
timeout 240 python benchmarks/engine_overhead.py --device cuda --world-size 8 --rounds 6 --warmup 5 --steps 20 \
    --out "$OUT/engine_overhead_cuda.md" > "$OUT/engine_overhead_cuda.log" 2>&1
echo "engine_overhead exit $?" >> "$OUT/engine_overhead_cuda.log"
tail -n 25 "$OUT/gpu_tier.txt"; cat "$OUT/engine_overhead_cuda.md" 2>/dev/null || tail -n 20 "$OUT/engine_overhead_cuda.log"
