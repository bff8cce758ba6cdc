#!/usr/bin/env bash
# Create .venv (if missing) and install torch first, then the requirements.
# Usage: scripts/setup_env.sh TORCH_SPEC [extra requirement files...]
# Re-installs only when the torch spec or a requirements file changed (a stamp records both).
set -euo pipefail
torch_spec="${1:-torch==2.13.0}"; shift || true
python_bin="${PYTHON:-python3}"
venv=.venv
stamp="$venv/.installed"
want="$(printf '%s\n' "$torch_spec"; cat requirements.txt "$@" 2>/dev/null)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
  exit 0
fi
[ -x "$venv/bin/python" ] || "$python_bin" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
echo "[setup] installing $torch_spec (first, so requirements.txt cannot pull another build)"
"$venv/bin/python" -m pip install --quiet "$torch_spec"
echo "[setup] installing requirements.txt $*"
reqs=(-r requirements.txt)
for f in "$@"; do reqs+=(-r "$f"); done
"$venv/bin/python" -m pip install --quiet "${reqs[@]}"
printf '%s' "$want" > "$stamp"
echo "[setup] environment ready in $venv"
