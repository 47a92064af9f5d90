#!/usr/bin/env bash
# Issue 37, the direct write path on one GPU, in about 5 minutes (ROUNDS=1, with BASE): the
# direct-path GPU tests (the strided kernel and copier, two processes bit for bit through the
# prepared lists), the host time of one direct write's copy (row table against strided) with both
# kernels' device time against a torch copy, the strided kernel's (tile, num_warps) sweep, and the
# `1b` transfers (scattered, e2e, write, control, × copy) of this tree, and of `BASE=<dir>` (a
# checkout to compare with, e.g. `git archive f900f66`) run just before it in each of ROUNDS
# rounds (REPEATS transfers per row, median). Run from the repository root after the device
# set-up (nixl wheels, `python3 setup.py build_ext --inplace`); outputs go to $OUT (default
# /tmp/write-gpu): device.txt, gpu_tests.txt, probe.txt, sweep.txt, transfer-<tree>-<round>.txt,
# and summary.txt (the `tok:` lines of every run).
set -u
OUT=${OUT:-/tmp/write-gpu}
REPEATS=${REPEATS:-7}
ROUNDS=${ROUNDS:-1}   # each round runs BASE then this tree (~70 s each)
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/transfer/test_copy_kernels.py \
    tests/transfer/test_direct_gpu.py > "$OUT/gpu_tests.txt" 2>&1; echo "pytest rc=$?" >> "$OUT/gpu_tests.txt"
tail -n 6 "$OUT/gpu_tests.txt"
timeout 60 python3 bench/transfer/submit_probe.py --calls 200 --blocks 64 --blocks 1024 \
    --blocks 4096 > "$OUT/probe.txt" 2>&1; echo "submit_probe rc=$?" >> "$OUT/probe.txt"
grep -E "blocks:|rc=" "$OUT/probe.txt"
timeout 90 python3 bench/transfer/submit_probe.py --sweep > "$OUT/sweep.txt" 2>&1
echo "sweep rc=$?" >> "$OUT/sweep.txt"
cat "$OUT/sweep.txt"
trees=(.)
[ -n "${BASE:-}" ] && trees=("$BASE" .)
: > "$OUT/summary.txt"
for round in $(seq "$ROUNDS"); do
    for tree in "${trees[@]}"; do
        name=$([ "$tree" = . ] && echo this || echo base)
        f="$OUT/transfer-$name-$round.txt"
        (cd "$tree" && timeout 120 python3 bench/transfer/transfer.py --device cuda --geometry 1b \
            --agent nixl --repeats "$REPEATS" --no-real-prefill --no-write) > "$f" 2>&1
        echo "transfer.py rc=$?" >> "$f"
        grep -E "tok:|rc=" "$f" | sed "s|^|$name r$round |" | tee -a "$OUT/summary.txt"
    done
done
