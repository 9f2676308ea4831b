#!/usr/bin/env python3
"""The official `openai` Python client (PyPI), unmodified, against `inferscale serve`.

    test_openai_client.py INFERSCALE_BINARY MODEL.gguf

Starts `inferscale serve --no-auth --port 0` on 127.0.0.1 with a temporary data
directory, points `openai.OpenAI(base_url=...)` at it and checks, through the
client's own parsing of every response:
  - models.list() names the served model;
  - a non-streaming chat completion: an assistant message with text, a finish
    reason, usage counts within max_tokens (greedy: the same answer twice);
  - a streaming one with the same request: chunks the client parses, the
    role first, a final usage chunk, and the same text as the non-streaming
    answer;
  - memory through the client's standard extension points (`user`, and
    `extra_body={"memory": ...}`): a fact stored with POST /v1/memories/ is
    counted in usage.memory_tokens of a streamed answer in prompt mode;
  - an out-of-range memory.k surfaces as openai.BadRequestError (status 400,
    OpenAI's error object), and the server still answers afterwards.

Exit status 77 (ctest SKIP_RETURN_CODE) only when the `openai` package or the
model file is missing; anything else that goes wrong is a failure.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.request

SKIP = 77
MAX_TOKENS = 12


def skip(why):
    print(f"SKIP: {why}")
    sys.exit(SKIP)


def fail(why):
    print(f"FAIL: {why}")
    sys.exit(1)


def check(cond, why):
    if not cond:
        fail(why)


def main():
    if len(sys.argv) != 3:
        fail("usage: test_openai_client.py INFERSCALE_BINARY MODEL.gguf")
    binary, model = sys.argv[1], sys.argv[2]
    try:
        import openai
    except ImportError:
        skip("the openai Python package is not installed (pip install openai)")
    if not os.path.isfile(model):
        skip(f"model {model} not found (scripts/setup.sh installs it)")
    check(os.access(binary, os.X_OK), f"{binary} is not an executable")
    print(f"openai {openai.__version__}")

    # Loopback only: no proxy from the environment may see this traffic (the
    # client's httpx and urllib both read these variables).
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        os.environ.pop(k, None)
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"
    data = tempfile.mkdtemp(prefix="test_openai_client_")
    proc = subprocess.Popen(
        [binary, "serve", "-m", model, "--data", data, "--no-auth", "--host", "127.0.0.1",
         "--port", "0", "--embedder", "none", "--model-name", "smol", "-t", "2", "-c", "2048"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines, port_box, started = [], [], threading.Event()

    def read_stderr():
        for line in proc.stderr:
            lines.append(line.rstrip("\n"))
            if not port_box and line.startswith("serving on http://"):
                port_box.append(int(line.split("serving on http://", 1)[1].split()[0]
                                    .rsplit(":", 1)[1]))
                started.set()
        started.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        if not started.wait(180) or not port_box:
            fail("the server did not start:\n" + "\n".join(lines[-20:]))
        port = port_box[0]
        base = f"http://127.0.0.1:{port}"
        print(f"server on {base}")
        run_checks(openai, base)
        check(proc.poll() is None, "the server exited during the test")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        reader.join(5)
        shutil.rmtree(data, ignore_errors=True)
    check(proc.returncode == 0,
          f"the server exited with {proc.returncode} on SIGTERM:\n" + "\n".join(lines[-20:]))
    check(any("stopped cleanly" in l for l in lines), "the server did not report a clean stop")
    print("PASS")


def post_json(base, path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.status, json.loads(r.read())


def run_checks(openai, base):
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused-with-no-auth", max_retries=0,
                           timeout=120)

    models = [m.id for m in client.models.list()]
    check("smol" in models, f"models.list() gave {models}")

    messages = [{"role": "user", "content": "What is the capital of France? Answer briefly."}]
    # Non-streaming, twice: greedy decoding gives the same answer.
    r1 = client.chat.completions.create(model="smol", messages=messages, max_tokens=MAX_TOKENS,
                                        temperature=0)
    r2 = client.chat.completions.create(model="smol", messages=messages, max_tokens=MAX_TOKENS,
                                        temperature=0)
    check(r1.object == "chat.completion", f"object {r1.object!r}")
    check(len(r1.choices) == 1, f"{len(r1.choices)} choices")
    msg = r1.choices[0].message
    check(msg.role == "assistant", f"role {msg.role!r}")
    check(isinstance(msg.content, str) and msg.content.strip(), f"content {msg.content!r}")
    check(r1.choices[0].finish_reason in ("stop", "length"),
          f"finish_reason {r1.choices[0].finish_reason!r}")
    u = r1.usage
    check(u is not None and u.prompt_tokens > 0, f"usage {u}")
    check(1 <= u.completion_tokens <= MAX_TOKENS, f"completion_tokens {u.completion_tokens}")
    check(u.total_tokens == u.prompt_tokens + u.completion_tokens, f"total_tokens in {u}")
    if r1.choices[0].finish_reason == "length":
        check(u.completion_tokens == MAX_TOKENS, f"finish length at {u.completion_tokens} tokens")
    check(r2.choices[0].message.content == msg.content,
          f"greedy answers differ: {msg.content!r} vs {r2.choices[0].message.content!r}")
    print(f"non-streaming: {msg.content!r} ({u.prompt_tokens} prompt, "
          f"{u.completion_tokens} completion tokens)")

    # Streaming, the same request: the client's chunk parser over our SSE.
    stream = client.chat.completions.create(model="smol", messages=messages,
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    text, roles, finishes, usage, n_chunks = "", [], [], None, 0
    for chunk in stream:
        n_chunks += 1
        check(chunk.object == "chat.completion.chunk", f"chunk object {chunk.object!r}")
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            if c.delta.content:
                text += c.delta.content
            if c.finish_reason:
                finishes.append(c.finish_reason)
    check(roles[:1] == ["assistant"], f"roles in the stream: {roles}")
    check(len(finishes) == 1, f"finish reasons in the stream: {finishes}")
    check(usage is not None, "no usage chunk in the stream")
    check(usage.completion_tokens == u.completion_tokens,
          f"streamed completion_tokens {usage.completion_tokens} vs {u.completion_tokens}")
    check(text == msg.content, f"streamed text {text!r} differs from {msg.content!r}")
    print(f"streaming: {n_chunks} chunks, same text, usage {usage.completion_tokens} tokens")

    # Memory through the client's extension points.
    st, added = post_json(base, "/v1/memories/",
                          {"facts": ["Alice's favourite colour is teal."], "user_id": "alice",
                           "infer": False})
    check(st == 200 and len(added.get("results", [])) == 1, f"memory add: {st} {added}")
    stream = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "What is my favourite colour?"}],
        max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, user="alice",
        extra_body={"memory": {"k": 5, "mode": "prompt"}})
    mem_usage, text = None, ""
    for chunk in stream:
        if chunk.usage is not None:
            mem_usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
    check(mem_usage is not None, "no usage chunk with memory")
    extra = mem_usage.model_dump()
    check(extra.get("memory_tokens", 0) > 0, f"memory_tokens not reported or 0: {extra}")
    check(extra.get("ttft_ms", 0) > 0, f"ttft_ms not reported: {extra}")
    print(f"with memory: {extra['memory_tokens']} memory tokens, TTFT {extra['ttft_ms']:.1f} ms, "
          f"answer {text!r}")

    # An OpenAI-style error object becomes the client's exception.
    try:
        client.chat.completions.create(model="smol", messages=messages, max_tokens=4, user="alice",
                                       extra_body={"memory": {"k": 100000}})
        fail("k = 100000 was accepted")
    except openai.BadRequestError as e:
        check(e.status_code == 400, f"status {e.status_code}")
        check(isinstance(e.body, dict) and e.body.get("message"), f"error body {e.body}")
        print(f"k out of range: BadRequestError 400, {e.body.get('message')!r}")
    again = client.chat.completions.create(model="smol", messages=messages, max_tokens=2,
                                           temperature=0)
    check(again.usage.completion_tokens >= 1, "no answer after the error")


if __name__ == "__main__":
    main()
