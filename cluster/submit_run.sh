#!/usr/bin/env bash
# Run on the cluster's head by `ray submit cluster/aws.yaml cluster/submit_run.sh CONFIG [rollout run options]`:
# joins the running cluster (RAY_ADDRESS=auto) and runs the rollouts there.
set -euo pipefail
cd ~/rollout-executor
export RAY_ADDRESS=auto RAY_AUTH_MODE=token RAY_USAGE_STATS_ENABLED=0
exec ~/venv/bin/rollout run "$@"
