#!/usr/bin/env bash
# Set up (idempotent), then bring the whole stack up without Docker — Redis, the prefix index,
# the engine on the default model — and print a streamed completion.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The interpreter setup.sh installed into ($PYTHON, as there), not whichever python3 is first.
exec "${PYTHON:-python3}" -m engine_service.tools.stack "$@"
