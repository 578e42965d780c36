#!/usr/bin/env bash
# Makes the peers' environment and prints its Python on stdout: the libraries a user could pick
# instead of treetensor, our oracles and rivals (benchmarks and tests only, never a runtime
# dependency): di-treetensor 0.5.0 with treevalue 1.5.0, tensordict 0.15.3, optree 0.20.0.
#
# It is a venv of its own (TREETENSOR_PEERS_VENV, default ~/.cache/treetensor/peers) layered
# over the project's venv (setup.sh) by a .pth file, so it sees that venv's torch and numpy and
# pip installs only the peers (a few MB, seconds) instead of a second 4 GB torch. Its own
# site-packages come first on sys.path, so there `import treetensor` is DI-treetensor's package
# (the same name as ours): run our side from the project's venv, in another process.
# Idempotent: a second run takes about a second.
set -euo pipefail
cd "$(dirname "$0")/.."

base=$(bash scripts/setup.sh)
peers="${TREETENSOR_PEERS_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/treetensor/peers}"
pins=(di-treetensor==0.5.0 treevalue==1.5.0 tensordict==0.15.3 optree==0.20.0)
stamp="$peers/.treetensor-peers-$(printf '%s\n' "${pins[@]}" | md5sum | cut -c1-12)"

if [ ! -f "$stamp" ]; then
  echo "setup: making the peers' venv $peers (${pins[*]})" >&2
  start=$(date +%s)
  [ -x "$peers/bin/python" ] || "$base/bin/python" -m venv "$peers" >&2
  site() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
  site "$base/bin/python" >"$(site "$peers/bin/python")/treetensor-base-venv.pth"
  if ! "$peers/bin/python" -m pip install -q "${pins[@]}" >&2; then
    echo "setup: pip could not install ${pins[*]} into $peers (see pip's messages above)" >&2
    exit 1
  fi
  # torch must be the project venv's, never a second copy that pip pulled in as a dependency.
  if ! "$peers/bin/python" - "$base" <<'EOF' >&2; then
import sys, torch
sys.exit(0 if torch.__file__.startswith(sys.argv[1]) else f"setup: the peers' venv imports torch from {torch.__file__}, not from {sys.argv[1]}")
EOF
    exit 1
  fi
  touch "$stamp"
  echo "setup: peers' venv ready in $(( $(date +%s) - start )) s" >&2
fi
echo "$peers/bin/python"
