#!/usr/bin/env bash
# The one command to run on a GPU machine (one H100 or H200, in under 10 minutes): `python bench.py gpu`, every
# section against its baseline in about 8 minutes, its table and its JSON under $OUT (what comes back).
#   nanoGPT's model.py is read from $NANOGPT (default ./nanogpt: a checkout placed there, ignored by git so that it is
#   never committed; hand it to the GPU machine with the working tree, e.g. the device tool's `carry: ["nanogpt"]`;
#   without it the training row times ours alone and says why).
#   DEVICE, DTYPE, PRESET, MINUTES override the defaults (cuda, bfloat16, base, 8), e.g. for a CPU rehearsal:
#   DEVICE=cpu DTYPE=float32 PRESET=tiny MINUTES=1 OUT=/tmp/gpu bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
NANO=${NANOGPT:-nanogpt}
extra=()
if [ -f "$NANO/model.py" ]; then extra=(--nanogpt "$NANO"); else echo "no $NANO/model.py: the train row times ours alone" > "$OUT/gpu.txt"; fi
(nvidia-smi; python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'transformers', transformers.__version__)") > "$OUT/versions.txt" 2>&1
timeout -k 10 560 python bench.py gpu --device "${DEVICE:-cuda}" --dtype "${DTYPE:-bfloat16}" --preset "${PRESET:-base}" \
    --minutes "${MINUTES:-8}" "${extra[@]}" --json "$OUT/gpu.json" 2>&1 | tee -a "$OUT/gpu.txt"
rc=${PIPESTATUS[0]}
echo "exit status $rc (124: the outer timeout; the JSON holds every section finished before it)" | tee -a "$OUT/gpu.txt"
exit "$rc"
