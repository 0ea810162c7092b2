#!/bin/sh
# Install this vLLM DFlash bundle offline, from the wheels beside this script.
#   sh install.sh                 into the current Python environment
#   sh install.sh --target DIR    into DIR; then export PYTHONPATH=DIR
# PYTHON=/path/to/python3 picks the interpreter (default: python3).
set -eu
here=$(CDPATH='' cd -- "$(dirname -- "$0")" && pwd)
python=${PYTHON:-python3}
target=
while [ $# -gt 0 ]; do
  case $1 in
    --target) [ $# -ge 2 ] || { echo "install.sh: --target needs a folder" >&2; exit 2; }
              target=$2; shift 2 ;;
    --target=*) target=${1#--target=}; shift ;;
    -h|--help) sed -n '2,5p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
# What the bundle left out as the host's must be here at the version it was resolved with;
# checked before anything is installed (exit 3 and one line otherwise).
if [ -f "$here/present.txt" ]; then
  "$python" "$here/check_present.py" "$here/present.txt" ${target:+"$target"}
fi
# The host's pip.conf (indexes, constraints) has no say: everything is here.
export PIP_CONFIG_FILE=/dev/null
# --no-deps: the bundle was resolved as a whole; what it leaves out the host has.
set -- --no-index --no-deps --require-hashes --find-links "$here/wheels" -r "$here/install.txt"
if [ -n "$target" ]; then
  "$python" -m pip install --upgrade --target "$target" "$@"
  echo "installed into $target; use it with:"
  echo "  export PYTHONPATH=$target\${PYTHONPATH:+:\$PYTHONPATH}"
else
  "$python" -m pip install "$@"
fi
