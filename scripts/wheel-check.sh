#!/usr/bin/env bash
# The package as users install it: build rvqtts's wheel from this checkout, install it in a fresh virtual
# environment outside the checkout, and run from there what a user runs first: synth (one line and a batch), read
# (a Markdown book to an audiobook), bench predictor and serve, on a tiny checkpoint and an empty measurement cache.
# .ci/run calls it.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
server=""
# the server stopped and waited for before its folder goes: at shutdown it writes what it learned into the cache
trap 'if [ -n "$server" ]; then kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; fi; rm -rf "$work"' EXIT
cd "$work"
python3 -m venv venv && . venv/bin/activate
pip wheel -q --no-deps -w dist "$repo"
pip install -q -c "$repo/.ci/constraints.txt" "$(ls dist/rvqtts-*.whl)[serve]"
export RVQTTS_CACHE="$work/cache"
python -c "import rvqtts, sys; sys.exit(rvqtts.__file__.startswith('$repo/') and 'rvqtts was imported from the checkout')"
rvqtts make-tiny-model tiny-model
rvqtts synth "Hello from a wheel." --model tiny-model --max-frames 8 -o wheel.wav
printf 'One line from a wheel.\nAnother line.\n' > lines.txt
rvqtts synth -f lines.txt --model tiny-model --max-frames 8 --out-dir batch
test -f batch/0001.wav -a -f batch/0002.wav
printf '# A Book\n\n## One\n\nThe first chapter.\n\n## Two\n\nThe second chapter.\n' > book.md
rvqtts read book.md --model tiny-model --max-frames 8 --out-dir book
python -c "import av; assert [c['metadata']['title'] for c in av.open('book/a-book.m4b').chapters()] == ['One', 'Two']"
rvqtts bench predictor --model tiny-model --q 1,5 --repeats 3 --quiet --json bench.json
rvqtts serve --model tiny-model --port 8871 &
server=$!
for _ in $(seq 120); do curl -sf http://127.0.0.1:8871/ready >/dev/null && break; sleep 1; done
curl -sf http://127.0.0.1:8871/v1/audio/speech -H 'Content-Type: application/json' \
    -d '{"input": "Hello, served from a wheel.", "voice": "vivian", "max_frames": 8}' -o served.wav
python -c "import soundfile; assert soundfile.info('served.wav').frames > 0 and soundfile.info('wheel.wav').frames > 0"
curl -sf http://127.0.0.1:8871/metrics | grep -q '^rvqtts_requests_total{outcome="served"} 1.0$'
curl -sf http://127.0.0.1:8871/ -o page.html  # the web page and the API's, their files shipped in the wheel
grep -q 'rvqtts' page.html
grep -q '<script' page.html
curl -sf http://127.0.0.1:8871/page/page.js -o /dev/null
curl -sf http://127.0.0.1:8871/docs | grep -q '<script src="page/docs.js"'
curl -sf http://127.0.0.1:8871/page/docs.js -o /dev/null
echo "wheel check: synth, a batch, read, bench predictor, serve, its metrics and its pages ran from $(ls dist)"
