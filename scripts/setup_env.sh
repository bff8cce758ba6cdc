#!/usr/bin/env bash
# Create .venv (if missing) and install torch first, then the requirements.
# Usage: scripts/setup_env.sh TORCH_SPEC [extra requirement files...]
# Re-installs only when the torch spec or a requirements file changed (a stamp records both).
set -euo pipefail
torch_spec="${1:-torch==2.13.0}"; shift || true
python_bin="${PYTHON:-python3}"
venv=.venv
stamp="$venv/.installed"
# The stamp: the torch spec, then each requirements file under a "== NAME ==" line. A stamp that holds more files
# than asked for covers the request (make demo after make test installs nothing).
want="$(printf '%s\n' "$torch_spec"; for f in requirements.txt "$@"; do printf '== %s ==\n' "$f"; cat "$f"; done)"
if [ -f "$stamp" ] && [ -x "$venv/bin/python" ]; then
  have="$(cat "$stamp")"
  case "$have" in
    "$want" | "$want"$'\n== '*) exit 0 ;;
  esac
fi
[ -x "$venv/bin/python" ] || "$python_bin" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip \
  || echo "[setup] could not upgrade pip (offline?); going on with $("$venv/bin/python" -m pip --version)"
echo "[setup] installing $torch_spec (first, so requirements.txt cannot pull another build)"
"$venv/bin/python" -m pip install --quiet "$torch_spec"
echo "[setup] installing requirements.txt $*"
reqs=(-r requirements.txt)
for f in "$@"; do reqs+=(-r "$f"); done
"$venv/bin/python" -m pip install --quiet "${reqs[@]}"
printf '%s' "$want" > "$stamp"
echo "[setup] environment ready in $venv"
