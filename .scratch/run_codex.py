"""Run the scripted model and Codex inside this (network-isolated) process tree."""
import asyncio, json, os, sys
sys.path.insert(0, "/work/main")
from harnesses.scripted_model import ScriptedModel, parse_steps

async def main(scenario: str) -> None:
    scripts = {
        "text": [{"type": "text", "text": "Hello from the scripted model, this is a longer answer."}],
        "tool": [{"type": "shell", "command": "echo hi > hello.txt && cat hello.txt"},
                 {"type": "text", "text": "done"}],
        "write": [{"type": "write", "path": "sub/it's.txt", "content": "line1\n$HOME 'q' \"dq\"\n"},
                  {"type": "text", "text": "written"}],
        "nousage": [{"type": "text", "text": "no usage here", "usage": False}],
        "length": [{"type": "text", "text": "cut short", "finish_reason": "length"}],
        "e429": [{"type": "error", "status": 429, "headers": {"Retry-After": "1"}}],
        "e400": [{"type": "error", "status": 400}],
        "drop": [{"type": "drop", "after_chunks": 2}, {"type": "text", "text": "recovered"}],
    }
    model = ScriptedModel(parse_steps(scripts[scenario]))
    await model.start()
    home = "/work/main/.scratch/cx/home-" + scenario
    work = "/work/main/.scratch/cx/work-" + scenario
    os.makedirs(home, exist_ok=True); os.makedirs(work, exist_ok=True)
    with open(home + "/config.toml", "w") as f:
        f.write(f'''model = "fake-model"
model_provider = "fake"
approval_policy = "never"
sandbox_mode = "danger-full-access"
check_for_update_on_startup = false
[model_providers.fake]
name = "Fake"
base_url = "{model.base_url}"
env_key = "FAKE_API_KEY"
wire_api = "responses"
[analytics]
enabled = false
[feedback]
enabled = false
''')
    env = {**os.environ, "CODEX_HOME": home, "FAKE_API_KEY": "sk-fake"}
    proc = await asyncio.create_subprocess_exec(
        "/tmp/cx/p/node_modules/.bin/codex", "exec", "--json", "--skip-git-repo-check", "-C", work, "do it",
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    print("rc", proc.returncode)
    print(out.decode())
    print("STDERR", err.decode()[-2000:])
    for r in model.requests("default"):
        print("REQ", r.path, r.api, r.aux, r.step_index, r.step_type, r.stream, sorted(r.body)[:30])
    if os.path.exists(work):
        for root, _, files in os.walk(work):
            for fn in files:
                p = os.path.join(root, fn); print("FILE", p, repr(open(p).read()))
    if os.environ.get("DUMP"): json.dump(model.requests("default")[0].body, open(os.environ["DUMP"], "w"))
    await model.stop()

asyncio.run(main(sys.argv[1]))
