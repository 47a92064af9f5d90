#!/usr/bin/env bash
# Issue 37 item 2 on one GPU, in about 3 minutes: the direct-path GPU tests (bit for bit through the
# control lanes and the results carrying CUDA events; the copy's stream switch), the control round
# trip (nixl; `BASE=<dir>` adds a checkout to compare with, alternating), what one wake-up costs on
# this host, the host time of one direct write's copy, and the `1b` transfers (scattered, e2e,
# × copy). Run from the repository root, after the device set-up; outputs go to $OUT (default
# /tmp/control-gpu): gpu_tests.txt, control.txt, control_spin.txt, wakeup.txt, probe.txt,
# transfer.txt, build.txt. A BASE checkout on the device (e.g. one carried in an ignored folder:
# `git archive f900f66 --prefix=tmp/base-f900f66/ | tar -x` in the repository root, then
# BASE=tmp/base-f900f66) is measured alternately with this tree in control.txt.
set -u
OUT=${OUT:-/tmp/control-gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
# the native modules: transfer/_spin.c is the listeners' busy-poll (without it they never spin)
python3 setup.py build_ext --inplace -q > "$OUT/build.txt" 2>&1; echo "build_ext rc=$?" >> "$OUT/build.txt"
# without setuptools (a Python 3.12 venv has none by default): the one module, straight with cc
python3 -c "import transfer._spin" 2>/dev/null || { cc -O2 -shared -fPIC \
    -I"$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" transfer/_spin.c \
    -o "transfer/_spin$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')" \
    >> "$OUT/build.txt" 2>&1; echo "cc transfer/_spin.c rc=$?" >> "$OUT/build.txt"; }
python3 -c "import os, transfer.zmq_io as z, transfer.states as s; print('spin native', z.SPIN_NATIVE, \
'default spin_s', s.TransferConfig().spin_window_s, 'cpus', s.usable_cpus())" 2>&1 | tee -a "$OUT/build.txt"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/transfer/test_copy_kernels.py \
    tests/transfer/test_direct_gpu.py > "$OUT/gpu_tests.txt" 2>&1; echo "pytest rc=$?" >> "$OUT/gpu_tests.txt"
tail -n 8 "$OUT/gpu_tests.txt"
trees=(--tree .)
[ -n "${BASE:-}" ] && trees=(--tree "$BASE" --tree .)
timeout 60 python3 bench/transfer/control.py --agent nixl --n 200 --rounds 2 "${trees[@]}" \
    > "$OUT/control.txt" 2>&1; echo "control.py rc=$?" >> "$OUT/control.txt"
tail -n 26 "$OUT/control.txt"
# this tree with its listeners never spinning and spinning 500 µs (TransferConfig.spin_s; off by
# default, not yet measured on a GPU host), alternated round by round
timeout 90 python3 bench/transfer/control.py --agent nixl --n 200 --rounds 3 --spin-us 0 --spin-us 500 \
    > "$OUT/control_spin.txt" 2>&1; echo "control.py --spin-us rc=$?" >> "$OUT/control_spin.txt"
tail -n 26 "$OUT/control_spin.txt"
timeout 20 python3 bench/transfer/wakeup_probe.py --n 3000 > "$OUT/wakeup.txt" 2>&1
cat "$OUT/wakeup.txt"
timeout 30 python3 bench/transfer/submit_probe.py --calls 200 > "$OUT/probe.txt" 2>&1
grep -E "blocks:" "$OUT/probe.txt"
timeout 60 python3 bench/transfer/transfer.py --device cuda --geometry 1b --agent nixl --repeats 3 \
    --no-real-prefill --no-write > "$OUT/transfer.txt" 2>&1; echo "transfer.py rc=$?" >> "$OUT/transfer.txt"
grep -E "tok:|TTFT|rc=" "$OUT/transfer.txt"
