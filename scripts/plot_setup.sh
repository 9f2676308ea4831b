#!/usr/bin/env bash
# Installs what bench/plot_results.py needs (matplotlib, from PyPI) and draws the
# plots of BENCHMARKS.md into docs/plots/. Not part of the build or of CI: the
# plots are committed, and only a new results CSV calls for drawing them again.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c 'import matplotlib' 2>/dev/null; then
  python3 -m pip install --quiet --disable-pip-version-check matplotlib 2>/dev/null ||
    python3 -m pip install --quiet --disable-pip-version-check --break-system-packages matplotlib
fi
python3 bench/plot_results.py "$@"
