#!/bin/bash
# usage: run.sh MODE [cmd] ; runs inside a fresh netns
set -u
MODE=$1; shift
rm -rf home ws requests.jsonl; mkdir -p home/.codex ws
cat > home/.codex/config.toml <<T
model = "fake-model"
model_provider = "rollout"
approval_policy = "never"
sandbox_mode = "danger-full-access"
check_for_update_on_startup = false
[model_providers.rollout]
name = "Rollout"
base_url = "http://127.0.0.1:18080/v1"
env_key = "ROLLOUT_API_KEY"
wire_api = "responses"
${RETRY_KNOBS:-}
[analytics]
enabled = false
[feedback]
enabled = false
T
ip link set lo up
[ "$MODE" = refused ] || /work/main/.venv/bin/python fake.py 18080 $MODE "$@" &
SP=$!
for i in $(seq 50); do (echo > /dev/tcp/127.0.0.1/18080) 2>/dev/null && break; sleep 0.1; done
cd ws
env -i TZ=${TZX:-UTC} PATH=/usr/bin:/bin HOME=$PWD/../home CODEX_HOME=$PWD/../home/.codex ROLLOUT_API_KEY=sk-x timeout 120 /tmp/cx/p/node_modules/.bin/codex exec --json --skip-git-repo-check -C $PWD -o /work/main/.scratch/home/last.txt "say hi" </dev/null >../out.jsonl 2>../err.txt
echo "rc=$?"
cd ..
kill $SP
