#!/usr/bin/env bash
# The GPU check of issue 46, prepared to run once on a bare GPU machine without network, in under 10 minutes:
#   WHEELS=.whl OUT=gpu-figures bash scripts/gpu-check.sh
# WHEELS holds three folders of wheels, fetched as docs/gpu.md says from scripts/gpu-wheels/*.txt: common (what the
# image lacks), rvqtts (qwen-tts 0.1.1 and its transformers 4.57.3) and faster (faster-qwen3-tts 0.5.4, which runs on
# the image's own transformers 5.x). Each goes to its own folder (pip --target, no dependencies resolved) beside the
# machine's packages and CUDA torch; rvqtts runs from this checkout. It builds random-weight checkpoints at the released 0.6B dimensions (and the
# paper-acceptance one), checks speculative == plain and batched == one-line codes on the device, and times rvqtts
# against stock qwen-tts (bench e2e), faster-qwen3-tts on the same checkpoint and texts, and batches of 1, 4 and 16.
# Every step's output goes to OUT (STEP.log, figures as JSON) and one line per step to OUT/summary.tsv; a step that
# fails is recorded and the others run. DEVICE=cpu MODEL_DIMS=tiny STEPS="checkpoints identity" runs the same checks
# on a CPU (the test suite does).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-figures}
DEVICE=${DEVICE:-cuda}
MODEL_DIMS=${MODEL_DIMS:-0.6b}  # tiny: the test suite's small checkpoint
FRAMES=${FRAMES:-40}
OFFSET_STEPS=${OFFSET_STEPS:-2000}  # training steps of the paper-acceptance checkpoint's offsets
STEPS=${STEPS:-install device checkpoints identity e2e faster batch paper}
SITE=${SITE:-/tmp/gpu-check-site}
export PYTHONPATH="$SITE/rvqtts:$SITE/common:$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
: > "$OUT/summary.tsv"

step() {  # step NAME SECONDS COMMAND...: run it, log it, record ok or its exit status, go on
    local name=$1 seconds=$2
    shift 2
    [[ " $STEPS " == *" $name "* ]] || return 0
    local begun=$SECONDS
    if timeout "$seconds" bash -c "$*" > "$OUT/$name.log" 2>&1; then status=ok; else status="failed ($?)"; fi
    printf '%s\t%s\t%ss\n' "$name" "$status" "$((SECONDS - begun))" | tee -a "$OUT/summary.tsv"
}

install() {  # each folder of WHEELS into its own target (without WHEELS: what is installed is used)
    local group
    for group in common rvqtts faster; do
        [[ -z "${WHEELS:-}" ]] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE/$group" "$WHEELS/$group"/*.whl || return 1
    done
    python3 -c "import rvqtts.qwen.checkpoints, transformers, torch; print(transformers.__version__, torch.__version__)"
}

rvqtts() {  # rvqtts from this checkout, on the path above
    python3 -m rvqtts.cli "$@"
}

device() {
    nvidia-smi || true
    python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())"
}

checkpoints() {
    local dims=()
    [[ "$MODEL_DIMS" == tiny ]] || dims=(--dims "$MODEL_DIMS")
    rvqtts make-tiny-model --force "$OUT/model" "${dims[@]}" &&
        { [[ "$MODEL_DIMS" == tiny ]] || rvqtts make-tiny-model --force "$OUT/paper" "${dims[@]}" --acceptance paper; }
    printf '%s\n' "The quick brown fox jumps over the lazy dog." "A second line, a little longer than the first one." \
        "Short." "The fourth line has two sentences. This is the second." > "$OUT/texts.txt"
}

same_codes() {  # same_codes A B: two .npy files or folders of them hold equal codes
    python3 - "$1" "$2" <<'PY'
import sys
from pathlib import Path
import numpy as np
a, b = map(Path, sys.argv[1:])
pairs = [(a, b)] if a.is_file() else [(f, b / f.name) for f in sorted(a.glob("*.npy"))]
assert pairs, f"no codes in {a}"
for left, right in pairs:
    x, y = np.load(left), np.load(right)
    assert x.shape == y.shape and np.array_equal(x, y), f"{left} and {right} differ"
print(f"{len(pairs)} utterance(s): the same codes")
PY
}

identity() {  # speculative == plain, batched == one-line, on the device, in the dtype auto picks
    local model=$OUT/model common=(--model "$OUT/model" --device "$DEVICE" --max-frames "$FRAMES" --seed 7 -q)
    rvqtts synth "The quick brown fox jumps over the lazy dog." "${common[@]}" --tree 15 -o "$OUT/spec.wav" \
        --codes-out "$OUT/spec.npy" --stats-json "$OUT/spec-stats.json" &&
        rvqtts synth "The quick brown fox jumps over the lazy dog." "${common[@]}" --no-spec -o "$OUT/plain.wav" \
            --codes-out "$OUT/plain.npy" &&
        same_codes "$OUT/spec.npy" "$OUT/plain.npy" &&
        rvqtts synth -f "$OUT/texts.txt" "${common[@]}" --batch-size 4 --out-dir "$OUT/batched" --codes-out "$OUT/batched-codes" &&
        rvqtts synth -f "$OUT/texts.txt" "${common[@]}" --batch-size 1 --out-dir "$OUT/one" --codes-out "$OUT/one-codes" &&
        same_codes "$OUT/batched-codes" "$OUT/one-codes"
}

e2e() {
    rvqtts bench e2e --model "$OUT/model" --texts "$OUT/texts.txt" --device "$DEVICE" --max-frames "$FRAMES" \
        --json "$OUT/e2e.json"
}

faster() {  # faster-qwen3-tts 0.5.4 on the same checkpoint, texts and frames: audio seconds per wall second, after a warm-up
    PYTHONPATH="$SITE/faster:$SITE/common" python3 - "$OUT/model" "$OUT/texts.txt" "$OUT/faster.json" "$FRAMES" <<'PY'
import json, sys, time
import torch
from faster_qwen3_tts import FasterQwen3TTS
model_dir, texts_file, out, frames = sys.argv[1:]
texts = [line for line in open(texts_file).read().splitlines() if line.strip()]
model = FasterQwen3TTS.from_pretrained(model_dir)
speak = dict(speaker="vivian", language="English", max_new_tokens=int(frames) + 1)  # rvqtts's frames, as stock's
model.generate_custom_voice(text=texts[0], **speak)  # warm-up: its graphs captured
runs = []
for text in texts:
    torch.cuda.synchronize()
    begun = time.perf_counter()
    audio, rate = model.generate_custom_voice(text=text, **speak)
    torch.cuda.synchronize()
    runs.append({"text": text, "seconds": time.perf_counter() - begun, "audio_seconds": len(audio[0]) / rate})
total = {key: sum(run[key] for run in runs) for key in ("seconds", "audio_seconds")}
json.dump({"runs": runs, "audio_per_second": total["audio_seconds"] / total["seconds"]}, open(out, "w"), indent=1)
print(json.dumps(total))
PY
}

paper() {  # the paper-acceptance checkpoint with offsets trained on the texts: the default against --no-spec and trees
    rvqtts train-offsets --model "$OUT/paper" --texts "$OUT/texts.txt" --out "$OUT/paper-offsets.safetensors" \
        --max-steps "$OFFSET_STEPS" --device "$DEVICE" --force &&
        rvqtts bench e2e --model "$OUT/paper" --texts "$OUT/texts.txt" --offsets "$OUT/paper-offsets.safetensors" \
            --tree 4,8,16,32 --device "$DEVICE" --max-frames "$FRAMES" --json "$OUT/e2e-paper.json"
}

batch() {
    rvqtts bench batch --model "$OUT/model" --texts "$OUT/texts.txt" --sizes 1,4,16 --device "$DEVICE" \
        --max-frames "$FRAMES" --json "$OUT/batch.json"
}

export OUT DEVICE MODEL_DIMS FRAMES SITE OFFSET_STEPS
export -f install rvqtts device checkpoints same_codes identity e2e faster batch paper
step install 300 install
step device 60 device
step checkpoints 300 checkpoints
step identity 300 identity
step e2e 300 e2e
step faster 300 faster
step batch 300 batch
step paper 300 paper
! grep -q failed "$OUT/summary.tsv"
