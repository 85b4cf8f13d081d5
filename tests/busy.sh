#!/usr/bin/env bash
# Run a command beside two busy loops, as on a shared, loaded machine: a busy machine must
# change no answer and fail no test.   bash tests/busy.sh .ci/run   (or: make test-busy)
set -euo pipefail
python3 -c 'while True: pass' & first=$!
python3 -c 'while True: pass' & second=$!
trap 'kill $first $second 2>/dev/null' EXIT
"$@"
