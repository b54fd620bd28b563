#!/usr/bin/env bash
# Installs sdquant from its pyproject ranges alone (no constraints) into a venv that holds torch
# already, as a GPU image or an NVIDIA container does, then checks that pip kept that torch, that
# `pip check` is clean and that the scripts' start-up check accepts what pip chose. pip's cache
# serves the wheels: 95 s on the 2-core CI machine once it is warm.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
venv=$(mktemp -d -p /dev/shm 2>/dev/null || mktemp -d)
trap 'rm -rf "$venv"' EXIT
python3 -m venv "$venv"
py="$venv/bin/python"
torch_version() { "$py" -m pip show torch | sed -n 's/^Version: //p'; }

"$py" -m pip install -q --no-compile "$(grep '^torch==' constraints.txt)"
before=$(torch_version)
"$py" -m pip install -q --no-compile .
after=$(torch_version)
if [ "$before" != "$after" ]; then
    echo "ranges install: pip replaced torch $before with $after" >&2
    exit 1
fi
"$py" -m pip check
"$py" -c "from sdquant.environment import require_supported; require_supported()"
echo "ranges install: sdquant from its ranges kept torch $after, pip check clean ($((SECONDS - start)) s)"
