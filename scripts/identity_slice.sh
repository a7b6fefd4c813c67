#!/usr/bin/env bash
# Numbers unchanged by a refactor: one fixed-seed evaluation slice (every method at 10% and 20%, two tasks, SmolLM2
# and the test suite's tiny model) run on REF's tree and on this one, compared row for row by `kvstitch
# eval-compare`. Exits non-zero unless every (method, ratio) is identical on every sample.
#
#   bash scripts/identity_slice.sh REF [OUT]      # e.g. REF = main's last commit before the refactor
set -euo pipefail
ref=${1:?usage: identity_slice.sh REF [OUT]}
out=${2:-/tmp/kvstitch-identity}
root=$(cd "$(dirname "$0")/.." && pwd)
py=$root/.venv/bin/python
rm -rf "$out"
mkdir -p "$out"
git -C "$root" worktree add --detach "$out/base-tree" "$ref" >/dev/null
trap 'git -C "$root" worktree remove --force "$out/base-tree"' EXIT
"$py" "$root/scripts/save_tiny_model.py" "$out/tiny-llama"
slice=(--tasks niah_single_essay,niah_multikey --length 1024 --n 2 --methods all --ratios 0.1,0.2 --threads 2)
for model in smollm2 "$out/tiny-llama"; do
  name=$(basename "$model")
  for tree in base new; do
    dir=$root
    [ "$tree" = base ] && dir=$out/base-tree
    (cd "$dir" && PYTHONPATH="$dir" "$py" -c "from kvstitch.cli import app; app()" eval --model "$model" \
      "${slice[@]}" --out "$out/$tree-$name" >"$out/$tree-$name.log" 2>&1) \
      || { echo "eval failed on the $tree tree ($name): $out/$tree-$name.log" >&2; exit 1; }
  done
  "$py" -c "from kvstitch.cli import app; app()" eval-compare "$out/base-$name" "$out/new-$name" \
    --out "$out/compare-$name" >/dev/null
  "$py" - "$out/compare-$name/compare.json" "$name" <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1]))
rows = rows.get("rows", rows) if isinstance(rows, dict) else rows
bad = [r for r in rows if r.get("identical") is not None and r["identical"] < 1]
print(f"{sys.argv[2]}: {len(rows)} (method, ratio) cells, {len(rows) - len(bad)} identical")
for r in bad:
    print(f"  differs: {r.get('method')} r={r.get('ratio')}: identical {r['identical']:.2f}")
sys.exit(1 if bad or not rows else 0)
EOF
done
