#!/usr/bin/env bash
# Run a command while another process keeps one core busy (scripts/cpu_hog.py), then stop the
# hog by its PID. The exit code is the command's; the wall time is printed at the end.
#   scripts/under_load.sh make test
#   HOG_CORES=1 scripts/under_load.sh make demo
set -u
here="$(cd "$(dirname "$0")" && pwd)"
python3 "$here/cpu_hog.py" --cores "${HOG_CORES:-1}" &
hog=$!
trap 'kill -TERM "$hog" 2>/dev/null; wait "$hog" 2>/dev/null' EXIT
start=$(date +%s)
"$@"
code=$?
echo "under_load: '$*' exited $code after $(( $(date +%s) - start )) s beside ${HOG_CORES:-1} busy core(s)" >&2
exit $code
