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
die() { echo "[setup] error: $*" >&2; exit 2; }
# A venv that runs, with pip (a venv made without ensurepip has none; one whose base Python was removed does not run).
working() { "$venv/bin/python" -c 'import sys' >/dev/null 2>&1 && "$venv/bin/python" -m pip --version >/dev/null 2>&1; }
# The core packages are where the stamp says (found, not imported: no torch import on every make).
installed() {
  "$venv/bin/python" -c 'import importlib.util as u, sys
sys.exit(any(u.find_spec(m) is None for m in ("torch", "transformers", "datasets", "yaml", "tqdm")))' >/dev/null 2>&1
}
if [ -f "$stamp" ] && working && installed; then
  have="$(cat "$stamp")"
  case "$have" in
    "$want" | "$want"$'\n== '*) exit 0 ;;
  esac
fi
runs() { "$venv/bin/python" -c 'import sys' >/dev/null 2>&1; }
if [ -e "$venv" ] && runs && ! working; then  # a venv without pip (uv venv, no ensurepip): what it holds is kept
  die "$venv has no pip: install it there ($venv/bin/python -m ensurepip, or uv pip install --python $venv pip), or move $venv aside, then rerun"
fi
if [ -L "$venv" ] && ! runs; then
  die "$venv is a link to a venv whose python does not run; repair that venv, or remove the link, then rerun"
fi
if [ -e "$venv" ] && ! runs; then
  echo "[setup] $venv does not work (its python does not run: its base Python was removed?): making it again"
  rm -f "$stamp"
fi
if [ ! -e "$venv" ] || ! runs; then
  command -v "$python_bin" >/dev/null 2>&1 || die "no $python_bin found: install Python 3.10 or newer, or set PYTHON=/path/to/python3"
  "$python_bin" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || die "$python_bin is Python $("$python_bin" -c 'import platform; print(platform.python_version())'); torch $torch_spec needs 3.10 or newer: set PYTHON=/path/to/python3.1x"
  "$python_bin" -m venv --clear "$venv" \
    || die "$python_bin could not create $venv (on Debian/Ubuntu: apt install python3-venv), then rerun"
  working || die "$venv has no pip ($python_bin's venv module made it without ensurepip: on Debian/Ubuntu apt install python3-venv), then rerun"
fi
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
