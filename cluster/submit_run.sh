#!/usr/bin/env bash
# Run on the cluster's head by `ray submit cluster/aws.yaml cluster/submit_run.sh CONFIG [rollout run options]`:
# joins the running cluster (RAY_ADDRESS=auto) and runs the rollouts there. The output goes to ROLLOUT_OUT
# (s3://BUCKET/runs): the nodes share no disk, and an idle worker is deleted with its own. A --out among
# the options comes later on the command line and wins.
set -euo pipefail
out=${ROLLOUT_OUT:?set ROLLOUT_OUT to where the run goes: s3://BUCKET/runs, or a path every node shares}
cd ~/rollout-executor
export RAY_ADDRESS=auto RAY_AUTH_MODE=token RAY_USAGE_STATS_ENABLED=0
exec ~/venv/bin/rollout run --out "$out" "$@"
