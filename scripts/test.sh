#!/usr/bin/env bash
# The test command (README, CI): builds/reuses the environment, then runs every suite.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/unit -k nvfp4).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bash "$here/setup_env.sh"
source "$here/env.sh"
cd "$here/.."
# The environment is shared by every checkout on this machine (its editable install points at the
# checkout that last ran setup_env.sh); subprocesses and Ray workers must import THIS checkout.
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
# Triton kernels run under the interpreter on machines without a GPU.
if ! "$VQ_VENV/bin/python" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  export TRITON_INTERPRET=1
fi
exec "$VQ_VENV/bin/python" -m pytest -q -rs "$@"
