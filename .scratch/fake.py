# throwaway exploration server (deleted after)
import json, sys, asyncio
from aiohttp import web
MODE = sys.argv[2] if len(sys.argv) > 2 else "tool"
count = {"n": 0}
def sse(ev, data):
    return f"event: {ev}\ndata: {json.dumps(data)}\n\n".encode()
async def responses(req):
    body = await req.json()
    count["n"] += 1
    with open("requests.jsonl", "a") as f:
        f.write(json.dumps({"n": count["n"], "headers": dict(req.headers), "body": body}) + "\n")
    mode = MODE
    if mode.startswith("status"):
        plain = mode.endswith("p")
        st = int(mode[6:9])
        b = {"error": {"message": "gateway: session closed by gateway policy; no further model calls allowed", "type": "invalid_request_error", "code": "gateway_session_closed"}} if plain else {"error": {"message": "This model's maximum context length is 1000 tokens", "type": "invalid_request_error", "code": "context_length_exceeded"}} if st == 400 else {"error": {"message": "nope", "type": "x"}}
        return web.json_response(b, status=st, headers={"Retry-After": "0"})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(req)
    await resp.write(sse("response.created", {"type": "response.created", "response": {"id": "resp_1"}}))
    has_output = any(i.get("type") == "function_call_output" for i in body.get("input", []))
    if mode == "drop":
        await resp.write(b"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"he")
        return resp
    if mode == "tool" and not has_output:
        item = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "exec_command", "arguments": json.dumps({"cmd": sys.argv[3] if len(sys.argv) > 3 else "echo hi > hello.txt"})}
    else:
        item = {"type": "message", "id": "msg_1", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]}
    await resp.write(sse("response.output_item.done", {"type": "response.output_item.done", "item": item}))
    usage = {"input_tokens": 100, "input_tokens_details": {"cached_tokens": 10}, "output_tokens": 20, "output_tokens_details": {"reasoning_tokens": 5}, "total_tokens": 120}
    r = {"id": "resp_1"}
    if mode != "nousage":
        r["usage"] = usage
    await resp.write(sse("response.completed", {"type": "response.completed", "response": r}))
    return resp
app = web.Application()
app.router.add_post("/v1/responses", responses)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
