#!/usr/bin/env bash
# The judged routing run (issue 40) in one command, on the 16-core GPU host (Python 3.12, no
# network): both traces x 8 and 32 workers x both loads = 8 cells, each in its own process
# (bench/routing/routing.py --jobs), every cell replaying round_robin, kv_cache_aware with its
# defaults, conversation and the oracle. CPU only (sim workers): the GPU is not used.
#
#   OUT=/some/dir bench/routing/judged.sh          # on the host; writes OUT/cell-*.json and .log
#   python bench/routing/routing.py --from-json OUT/cell-*.json    # later, here: RESULTS.md + PNG
#
# Needs: .device-carry/whl (../shared/tools/stage_device.sh: the runtime wheels; numpy and pyyaml
# come from the host's Python), the Mooncake trace at .device-carry/trace/synthetic_trace.jsonl
# (or TRACE=...), gcc for the native router modules (else the Python recipes run: slower, the same
# decisions). Prints each cell's start and end, then every cell's per-policy lines.
# Sizing (JUDGED_ARGS below): see bench/RESULTS.md "routing" and docs/routing.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
D=${DEVICE_CARRY:-.device-carry}
OUT=${OUT:?set OUT: the folder for the JSON of the cells}
TRACE=${TRACE:-$D/trace/synthetic_trace.jsonl}
JOBS=${JOBS:-8}
PY=${PYTHON:-python3}
[ -f "$TRACE" ] || { echo "judged.sh: expected the Mooncake trace at $TRACE, found nothing (TRACE=...)" >&2; exit 2; }
if [ -d "$D/whl" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$D"/whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
$PY - <<'EOF' || { echo "judged.sh: a module the benchmark imports is missing (above)" >&2; exit 2; }
import aiohttp, numpy, yaml, zmq, prometheus_client, msgspec, xxhash, uvloop  # noqa: F401
EOF
# the native router modules, with setup.py's flags, built every time: a module left by an earlier
# run at another commit would pair this checkout's Python with an older C core (seen on the 2-core
# box: a coordinator failing every placement on a method the old module lacked)
if command -v gcc >/dev/null; then
    INC=$($PY -c "import sysconfig; print(sysconfig.get_paths()['include'])")
    SUF=$($PY -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
    for c in router/_*.c; do    # setup.py's extensions
        gcc -O2 -ffp-contract=off -shared -fPIC -I"$INC" "$c" -o "${c%.c}$SUF"
    done
else
    rm -f router/_*.so    # the Python recipes then
fi
$PY -c "import router.block_keys as b, router.policy_kv as p, router.kv_owners as o; print('native router modules:', b.NATIVE and p.NATIVE and o.NATIVE)"
mkdir -p "$OUT"
echo "$(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg), $(date -u '+%F %T') UTC, $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
# Dilation 2 (8 at 32 workers: --per-worker-load): every latency runs 2x slower than the H200
# model on the wall clock and is reported divided by 2, so the host's own overhead counts half.
# Measured on the 2-core box: a cell uses ~0.4-0.6 of a core at this dilation (the 8 cells ~4-5 of
# the 16), and the longest (conversations: 1,173 requests, ~27 s of model time per policy) takes
# ~4 policies x (2 x 27 s + ~5 s) + ~10 s to start its workers: ~4-5 minutes for the whole run.
# shellcheck disable=SC2086
$PY bench/routing/routing.py --jobs "$JOBS" --json-dir "$OUT" --no-write --trace "$TRACE" \
    --traces synthetic,conversations --workers 8,32 --loads light,heavy --dilation 2 \
    --policies 'round_robin;kv_cache_aware (defaults);conversation;oracle' ${JUDGED_ARGS:-}
echo "load average at the end $(cut -d' ' -f1-3 /proc/loadavg), $(date -u '+%F %T') UTC"
