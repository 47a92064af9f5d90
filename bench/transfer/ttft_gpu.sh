#!/usr/bin/env bash
# Issue 37 items 3-4 on one GPU, in about 4 minutes: the pipelined-send GPU test, the TTFT of a 16k
# prompt with the worker's engine doing the chunked prefill (pipelined vs monolithic vs prefill
# alone), and the one-GPU disagg_e2e dry run's TTFT alone at 2k/8k/32k (aggregated vs
# disaggregated). Run from the repository root, after the device set-up; outputs go to $OUT
# (default /tmp/ttft-gpu): gpu_tests.txt, transfer_ttft.txt, disagg_ttft.txt, disagg_ttft.json.
set -u
OUT=${OUT:-/tmp/ttft-gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
timeout 110 python3 bench/transfer/transfer.py --device cuda --agent nixl --ttft-only --no-write \
    > "$OUT/transfer_ttft.txt" 2>&1; echo "transfer.py rc=$?" >> "$OUT/transfer_ttft.txt"
tail -n 12 "$OUT/transfer_ttft.txt"
timeout 150 python3 bench/transfer/disagg_e2e.py --gpus 0 --parts ttft --start-timeout 90 \
    --request-timeout 60 --out "$OUT/disagg_ttft.json" --log-dir /tmp/ttft-gpu-logs \
    > "$OUT/disagg_ttft.txt" 2>&1; echo "disagg_e2e.py rc=$?" >> "$OUT/disagg_ttft.txt"
tail -n 22 "$OUT/disagg_ttft.txt"
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/worker_model/test_pipelined_send_gpu.py \
    tests/worker/test_async_scheduling.py > "$OUT/gpu_tests.txt" 2>&1
tail -n 15 "$OUT/gpu_tests.txt"
