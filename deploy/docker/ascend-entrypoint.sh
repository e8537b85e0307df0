#!/bin/bash
# Source the CANN environment (toolkit, ATB/NNAL) that Ascend images otherwise only set up for
# interactive shells, then exec the command given (proctor ...), so proctor is PID 1's child-free
# replacement and receives SIGTERM directly.
set -e
for f in \
    /usr/local/Ascend/ascend-toolkit/set_env.sh \
    /usr/local/Ascend/cann/set_env.sh \
    /usr/local/Ascend/nnal/atb/set_env.sh; do
  if [ -f "$f" ]; then
    # shellcheck disable=SC1090
    source "$f" > /dev/null 2>&1 || true
  fi
done
exec "$@"
