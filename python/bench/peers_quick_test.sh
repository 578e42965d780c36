#!/usr/bin/env bash
# ctest python_peers_quick: the peers workload on tiny sizes (python/bench/peers.py --quick),
# our package from PYTHON's environment (as python_pytest), the peers' venv made by
# scripts/peers-env.sh. Checks that every side is verified and timed, that the JSON feeds
# scripts/readme_tables.py, and that a side whose result is wrong fails the run (exit 2)
# instead of becoming a row.
#
#   bash python/bench/peers_quick_test.sh PYTHON
set -euo pipefail
cd "$(dirname "$0")/../.."
python="${1:?usage: peers_quick_test.sh PYTHON}"
peers=$(bash scripts/peers-env.sh)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

"$python" python/bench/peers.py --quick --peers-python "$peers" --json "$tmp/peers.json" >"$tmp/table"
cat "$tmp/table"
"$python" - "$tmp/peers.json" <<'PY'
import json, sys
data = json.load(open(sys.argv[1]))
cfg, rows = data["config"], data["results"]
assert cfg["all_verified"], "not every side verified"
sections = {r["section"] for r in rows}
assert sections == {"per-op", "structure", "seed", "optimizer"}, sections
timed = [r for r in rows if not r.get("status")]
assert all(r["verified"] and r["median_ms"] > 0 for r in timed), "a timed row without a time"
for side in ("ours", "ours consolidated", "DI-treetensor", "tensordict", "torch", "optree",
             "ours stream(2)", "torch fused", "ours flat"):
    assert any(r["strategy"] == side for r in timed), f"no timed row of {side}"
na = {(r["size"], r["strategy"]): r["status"] for r in rows if r.get("status")}
assert na[("seed matmul", "DI-treetensor stream(2)")].startswith("n/a"), na
assert not [s for s in na.values() if not s.startswith("n/a")], na
print(f"peers --quick: {len(timed)} rows verified and timed, {len(na)} n/a")
PY
python3 scripts/readme_tables.py --out "$tmp" --print >"$tmp/readme"
grep -q "Beside the peers" "$tmp/readme"

# A wrong result is an error, not a row.
rc=0
"$python" python/bench/peers.py --quick --peers-python "$peers" --perturb tensordict \
  >"$tmp/perturbed" 2>"$tmp/perturbed.err" || rc=$?
if [ "$rc" -ne 2 ] || ! grep -q "tensordict: result differs" "$tmp/perturbed.err"; then
  cat "$tmp/perturbed" "$tmp/perturbed.err"
  echo "peers_quick_test: a perturbed tensordict result was not caught (exit $rc)" >&2
  exit 1
fi
echo "peers_quick_test: passed"
