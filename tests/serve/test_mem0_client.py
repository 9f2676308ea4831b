#!/usr/bin/env python3
"""The official `mem0ai` clients (PyPI, 2.2.1 and 1.0.11), unmodified, against `inferscale serve`.

    test_mem0_client.py INFERSCALE_BINARY MODEL.gguf WORK_DIR

Installs mem0ai==2.2.1 (with its dependencies) into a throwaway virtual
environment under WORK_DIR, and mem0ai==1.0.11 beside it (--no-deps --target:
its dependencies are a subset of 2.2.1's), then starts two servers on
127.0.0.1 (default model and embedding model, temporary data): one with API keys
for two tenants, one with --no-auth. For each client version, this script runs
itself inside the virtual environment (--drive) and calls every MemoryClient
method that has a route here, and then every AsyncMemoryClient twin, checking
what comes back: the ping's org/project, add (user, agent-only and run-only
scopes; infer=true with the default model, which must store something), get,
get_all with filters (AND/OR/NOT, in, gte on created_at, metadata operators)
and pagination (count/next/previous), search (top_k, threshold, filters),
update, history, batch_update, batch_delete, delete, delete_all (both the
user_id and the filters form), users, delete_users, reset, the key check
(a wrong key fails at construction, the other tenant sees nothing), and that
an unsupported feature (get_summary, feedback) fails with an error naming it.

Exit status 77 (ctest SKIP_RETURN_CODE) only when PyPI cannot be reached (or
the model is missing); anything else that goes wrong is a failure.
"""
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

SKIP = 77
VERSIONS = ("2.2.1", "1.0.11")
KEY_A, KEY_B = "mem0-test-key-tenant-a", "mem0-test-key-tenant-b"


def skip(why):
    print(f"SKIP: {why}")
    sys.exit(SKIP)


def fail(why):
    print(f"FAIL: {why}")
    sys.exit(1)


def check(cond, why):
    if not cond:
        fail(why)


# ---- set-up: the virtual environment ------------------------------------------------------

def pypi_reachable():
    try:
        with urllib.request.urlopen("https://pypi.org/simple/mem0ai/", timeout=15) as r:
            return r.status == 200
    except Exception as e:  # noqa: BLE001 - any failure means "not reachable"
        print(f"PyPI check: {e}")
        return False


def make_venv(work):
    venv = os.path.join(work, "mem0-venv")
    py = os.path.join(venv, "bin", "python")
    v1 = os.path.join(venv, "mem0ai-1.0.11")
    stamp = os.path.join(venv, "installed-" + "-".join(VERSIONS))
    if os.path.exists(stamp):
        return py, v1
    if not pypi_reachable():
        skip("PyPI is not reachable: mem0ai cannot be installed")
    shutil.rmtree(venv, ignore_errors=True)
    steps = [
        [sys.executable, "-m", "venv", venv],
        [py, "-m", "pip", "install", "-q", "--disable-pip-version-check", f"mem0ai=={VERSIONS[0]}"],
        [py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", "--target", v1,
         f"mem0ai=={VERSIONS[1]}"],
    ]
    for cmd in steps:
        t0 = time.time()
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        print(f"{' '.join(cmd[-3:])}: {time.time() - t0:.0f} s")
        check(r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}")
    open(stamp, "w").close()
    return py, v1


# ---- the servers --------------------------------------------------------------------------

class Server:
    def __init__(self, binary, model, embedder, extra):
        self.data = tempfile.mkdtemp(prefix="test_mem0_client_")
        self.lines, self.port, started = [], None, threading.Event()
        self.proc = subprocess.Popen(
            [binary, "serve", "-m", model, "--embedder", embedder, "--data", self.data, "--host",
             "127.0.0.1", "--port", "0", "-t", "2", "-c", "2048", "--quiet"] + extra,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

        def read():
            for line in self.proc.stderr:
                self.lines.append(line.rstrip("\n"))
                if self.port is None and line.startswith("serving on http://"):
                    self.port = int(line.split()[2].rsplit(":", 1)[1])
                    started.set()
            started.set()

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()
        if not started.wait(300) or self.port is None:
            self.stop()
            fail("the server did not start:\n" + "\n".join(self.lines[-20:]))
        self.base = f"http://127.0.0.1:{self.port}"

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.reader.join(5)
        shutil.rmtree(self.data, ignore_errors=True)
        return self.proc.returncode


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "--drive":
        return drive(sys.argv[2], sys.argv[3], sys.argv[4])
    if len(sys.argv) != 4:
        fail("usage: test_mem0_client.py INFERSCALE_BINARY MODEL.gguf WORK_DIR")
    binary, model, work = sys.argv[1:4]
    if not os.path.isfile(model):
        skip(f"model {model} not found (scripts/setup.sh installs it)")
    # The embedding model beside it, named explicitly: serve's default is relative to the
    # working directory, and search with threshold needs embeddings.
    embedder = os.path.join(os.path.dirname(os.path.abspath(model)), "all-MiniLM-L6-v2")
    if not os.path.isdir(embedder):
        skip(f"embedding model {embedder} not found (scripts/setup.sh installs it)")
    check(os.access(binary, os.X_OK), f"{binary} is not an executable")
    os.makedirs(work, exist_ok=True)
    py, v1 = make_venv(work)

    for k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        os.environ.pop(k, None)
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"
    home = tempfile.mkdtemp(prefix="test_mem0_home_")
    env = dict(os.environ, MEM0_TELEMETRY="False", HOME=home, MEM0_DIR=os.path.join(home, ".mem0"),
               PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONPATH", None)
    keys = os.path.join(home, "keys.txt")
    with open(keys, "w") as f:
        f.write(f"# two tenants\n{KEY_A} tenant-a\n{KEY_B} tenant-b\n")
    servers = []
    try:
        servers.append(Server(binary, model, embedder, ["--keys", keys]))
        servers.append(Server(binary, model, embedder, ["--no-auth"]))
        for version in VERSIONS:
            e = dict(env)
            if version == VERSIONS[1]:
                e["PYTHONPATH"] = v1
            for srv, mode in ((servers[0], "auth"), (servers[1], "noauth")):
                t0 = time.time()
                r = subprocess.run([py, os.path.abspath(__file__), "--drive", version, srv.base, mode],
                                   env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   timeout=900)
                print(r.stdout.rstrip())
                check(r.returncode == 0, f"mem0ai {version} against the {mode} server failed")
                print(f"mem0ai {version}, {mode}: passed in {time.time() - t0:.1f} s")
        for s in servers:
            check(s.proc.poll() is None, "a server exited during the test:\n" + "\n".join(s.lines[-20:]))
    finally:
        codes = [s.stop() for s in servers]
        shutil.rmtree(home, ignore_errors=True)
    check(all(c == 0 for c in codes), f"the servers exited with {codes} on SIGTERM")
    print("PASS")


# ---- the driver (runs inside the virtual environment) --------------------------------------

def expect_error(fn, *words):
    """fn() must raise, with every word in the message (case-insensitive)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the clients raise several classes
        # 1.x's async client raises httpx's own error: the body is on its response.
        resp = getattr(e, "response", None)
        msg = " ".join([str(e), repr(getattr(e, "details", "")), repr(getattr(e, "debug_info", "")),
                        getattr(resp, "text", "") or ""])
        for w in words:
            check(w.lower() in msg.lower(), f"error {type(e).__name__}: {msg[:400]} lacks {w!r}")
        return e
    fail(f"{fn} did not raise")


class Api:
    """One client (sync or async) behind one interface; v2 names scopes in
    filters, v1 at the top level (each version's documented usage)."""

    def __init__(self, client, v2, is_async):
        self.c, self.v2, self.is_async = client, v2, is_async

    def run(self, x):
        return asyncio.get_event_loop().run_until_complete(x) if self.is_async else x

    def call(self, name, *a, **kw):
        return self.run(getattr(self.c, name)(*a, **kw))

    def scope(self, **ids):
        return {"filters": ids} if self.v2 else ids

    def add(self, messages, **kw):
        ids = {k: kw.pop(k) for k in ("user_id", "agent_id", "run_id") if k in kw}
        return self.call("add", messages, **self.scope(**ids), **kw)

    def get_all(self, filters=None, **kw):
        if self.v2:
            return self.call("get_all", filters=filters, **kw)
        # 1.x: ids at the top level are its documented form; filters too.
        if filters and set(filters) <= {"user_id", "agent_id", "run_id"} and \
                all(isinstance(v, str) for v in filters.values()):
            return self.call("get_all", **filters, **kw)
        return self.call("get_all", filters=filters, **kw)

    def search(self, query, filters, **kw):
        if not self.v2 and set(filters) <= {"user_id", "agent_id", "run_id"} and \
                all(isinstance(v, str) for v in filters.values()):
            return self.call("search", query, **filters, **kw)
        return self.call("search", query, filters=filters, **kw)


def results(r):
    check(isinstance(r, dict) and isinstance(r.get("results"), list), f"no results list in {r}")
    return r["results"]


def scenario(api, tag, with_infer):
    """Every method, checked by what it returns. tag keeps each run's users apart."""
    U, U2, AG, RUN = f"{tag}-caroline", f"{tag}-melanie", f"{tag}-agent", f"{tag}-run"

    # add: a user's memories with metadata, an agent-only one, a run-only one.
    r = results(api.add([{"role": "user", "content": "I moved to Lisbon last spring."},
                         {"role": "assistant", "content": "Lisbon is lovely."},
                         {"role": "user", "content": "I play the violin every evening."}],
                        user_id=U, infer=False, metadata={"topic": "life", "stars": 4}))
    texts = [m["memory"] for m in r]
    check(texts == ["I moved to Lisbon last spring.", "Lisbon is lovely.", "I play the violin every evening."],
          f"add stored {texts}")
    check(all(m["event"] == "ADD" and m["id"] for m in r), f"add results {r}")
    lisbon, violin = r[0]["id"], r[2]["id"]
    r = results(api.add("I have a dog named Max.", user_id=U2, infer=False, metadata={"topic": "pets", "stars": 2}))
    max_id = r[0]["id"]
    r = results(api.add("The agent answers in French.", agent_id=AG, infer=False))
    agent_mem = r[0]["id"]
    r = results(api.add("This session is about travel plans.", run_id=RUN, infer=False))
    run_mem = r[0]["id"]

    # get
    g = api.call("get", lisbon)
    check(g["id"] == lisbon and g["memory"] == "I moved to Lisbon last spring." and g["user_id"] == U
          and g["metadata"] == {"topic": "life", "stars": 4}, f"get gave {g}")
    g = api.call("get", agent_mem)
    check(g["agent_id"] == AG and g["user_id"] is None, f"agent-only memory: {g}")

    # get_all: scopes, pagination, the filter language
    r = api.get_all({"user_id": U})
    check(r.get("count") == 3 and len(results(r)) == 3 and "next" in r and "previous" in r, f"get_all: {r}")
    page1 = api.get_all({"user_id": U}, page=1, page_size=2)
    page2 = api.get_all({"user_id": U}, page=2, page_size=2)
    check(page1["count"] == 3 and len(page1["results"]) == 2 and page1["next"] and page1["previous"] is None,
          f"page 1: {page1}")
    check(len(page2["results"]) == 1 and page2["next"] is None and page2["previous"], f"page 2: {page2}")
    check({m["id"] for m in page1["results"] + page2["results"]} == {m["id"] for m in r["results"]},
          "the two pages do not cover the list")
    only = lambda f: sorted(m["memory"] for m in results(api.get_all(f)))  # noqa: E731
    check(only({"agent_id": AG}) == ["The agent answers in French."], "agent-only get_all")
    check(only({"run_id": RUN}) == ["This session is about travel plans."], "run-only get_all")
    check(len(results(api.get_all({"OR": [{"user_id": U}, {"user_id": U2}]}))) == 4, "OR")
    check(len(results(api.get_all({"user_id": {"in": [U2, AG]}}))) == 1, "in")
    check(len(results(api.get_all({"AND": [{"user_id": U}, {"metadata": {"stars": {"gte": 4}}}]}))) == 3, "gte")
    check(len(results(api.get_all({"AND": [{"user_id": {"in": [U, U2]}}, {"metadata": {"stars": {"lt": 4}}}]}))) == 1,
          "lt on metadata")
    check(len(results(api.get_all({"AND": [{"OR": [{"user_id": U}, {"user_id": U2}]},
                                           {"NOT": [{"metadata": {"topic": "pets"}}]}]}))) == 3, "NOT")
    check(len(results(api.get_all({"AND": [{"user_id": U2}, {"metadata": {"topic": {"icontains": "PET"}}}]}))) == 1,
          "icontains")
    check(len(results(api.get_all({"AND": [{"user_id": U}, {"metadata": {"topic": {"ne": "life"}}}]}))) == 0, "ne")
    check(len(results(api.get_all({"AND": [{"user_id": U}, {"created_at": {"gte": "2020-01-01"}},
                                           {"updated_at": {"lte": "2999-12-31T23:59:59Z"}}]}))) == 3, "dates")
    check(len(results(api.get_all({"AND": [{"user_id": U}, {"created_at": {"lt": "2020-01-01"}}]}))) == 0,
          "dates exclude")
    expect_error(lambda: api.get_all({"AND": [{"user_id": U}, {"categories": {"contains": "x"}}]}),
                 "categories", "not supported")

    # search: the right memory first, top_k, threshold, scopes
    s = results(api.search("Which city did the user move to?", {"user_id": U}, top_k=2))
    check(1 <= len(s) <= 2 and s[0]["id"] == lisbon and isinstance(s[0]["score"], (int, float)), f"search: {s}")
    s = results(api.search("violin music instrument", {"user_id": U}, top_k=1, threshold=0.2))
    check(len(s) == 1 and s[0]["id"] == violin and s[0]["score"] >= 0.2, f"search with threshold: {s}")
    s = results(api.search("violin music instrument", {"user_id": U}, threshold=0.99))
    check(all(m["score"] >= 0.99 for m in s), f"threshold not applied: {s}")
    s = results(api.search("language of the answers", {"agent_id": AG}))
    check([m["id"] for m in s] == [agent_mem], f"agent-only search: {s}")
    s = results(api.search("pets", {"OR": [{"user_id": U}, {"user_id": U2}]}, top_k=5))
    check(s and s[0]["id"] == max_id and len(s) == 4, f"OR search: {s}")

    # update, history
    u = api.call("update", lisbon, text="I moved to Porto last spring.")
    check(api.call("get", lisbon)["memory"] == "I moved to Porto last spring.", f"update: {u}")
    h = api.call("history", lisbon)
    check([e["event"] for e in h] == ["ADD", "UPDATE"] and h[1]["new_memory"] == "I moved to Porto last spring."
          and h[1]["old_memory"] == "I moved to Lisbon last spring.", f"history: {h}")
    api.call("update", lisbon, metadata={"topic": "moves"})
    check(api.call("get", lisbon)["metadata"] == {"topic": "moves"}, "metadata update")

    # batch update / delete
    b = api.call("batch_update", [{"memory_id": violin, "text": "I play the cello every evening."},
                                  {"memory_id": max_id, "metadata": {"topic": "dogs"}}])
    check("2" in b.get("message", ""), f"batch_update: {b}")
    check(api.call("get", violin)["memory"] == "I play the cello every evening.", "batch text")
    check(api.call("get", max_id)["metadata"] == {"topic": "dogs"}, "batch metadata")
    b = api.call("batch_delete", [{"memory_id": run_mem}])
    check("1" in b.get("message", ""), f"batch_delete: {b}")
    expect_error(lambda: api.call("get", run_mem), "not found")

    # users (entities)
    ents = results(api.call("users"))
    mine = {(e["type"], e["name"]): e["total_memories"] for e in ents if e["name"].startswith(tag)}
    check(mine == {("user", U): 3, ("user", U2): 1, ("agent", AG): 1}, f"users: {ents}")

    # infer=true (the default): the reply lists what was stored, and it is stored
    if with_infer:
        before = api.get_all({"user_id": U2})["count"]
        r = results(api.add([{"role": "user", "content": "My sister Anna is a pilot and she lives in Oslo."}],
                            user_id=U2))
        check(len(r) >= 1 and all(m["event"] == "ADD" for m in r), f"infer add stored nothing: {r}")
        after = api.get_all({"user_id": U2})
        check(after["count"] == before + len(r), f"infer add: {len(r)} listed, {after['count'] - before} stored")
        stored = {m["id"]: m["memory"] for m in after["results"]}
        check(all(stored.get(m["id"]) == m["memory"] for m in r), "infer add: listed texts differ from stored")

    # delete one, delete_users, delete_all, reset
    if api.v2:  # 2.x's delete_linked: no linked versions here, refused by name (and nothing deleted)
        expect_error(lambda: api.call("delete", violin, delete_linked=True), "delete_linked", "not supported")
        check(api.call("get", violin)["id"] == violin, "a refused delete deleted")
    d = api.call("delete", violin)
    check("deleted" in d.get("message", "").lower(), f"delete: {d}")
    expect_error(lambda: api.call("get", violin), "not found")
    api.call("delete_users", agent_id=AG)
    check(results(api.get_all({"agent_id": AG})) == [], "delete_users(agent_id)")
    r = api.call("delete_all", user_id=U)
    check(r.get("deleted") == 2 and api.get_all({"user_id": U})["count"] == 0, f"delete_all(user_id): {r}")
    if api.v2:
        r = api.call("delete_all", filters={"user_id": U2})
        check(r.get("deleted", 0) >= 1 and api.get_all({"user_id": U2})["count"] == 0, f"delete_all(filters): {r}")
    # unsupported features: an error that names them, not a 404
    expect_error(lambda: api.call("get_summary"), "summar", "not supported")
    expect_error(lambda: api.call("feedback", memory_id=lisbon, feedback="POSITIVE"), "feedback", "not supported")
    return lisbon


def drive(version, base, mode):
    import mem0
    from mem0 import AsyncMemoryClient, MemoryClient

    check(mem0.__version__ == version, f"imported mem0ai {mem0.__version__}, wanted {version}")
    v2 = version.startswith("2.")
    key = KEY_A if mode == "auth" else "any-key-works-without-auth"
    tenant = "tenant-a" if mode == "auth" else "default"
    print(f"mem0ai {version} ({mem0.__file__}) -> {base} [{mode}]")

    c = MemoryClient(api_key=key, host=base)
    check(c.org_id == "inferscale" and c.project_id == tenant, f"ping: org {c.org_id}, project {c.project_id}")
    if mode == "auth":
        expect_error(lambda: MemoryClient(api_key="not-a-valid-key-000", host=base), "401")
        other = Api(MemoryClient(api_key=KEY_B, host=base), v2, False)
    sync = Api(c, v2, False)
    tag = f"v{version[0]}-{mode}-sync"
    lisbon = scenario(sync, tag, with_infer=(mode == "noauth"))
    if mode == "auth":
        # The other tenant sees none of tenant A's memories, even by id.
        api = Api(c, v2, False)
        keep = results(api.add("Tenant A's secret.", user_id=f"{tag}-x", infer=False))[0]["id"]
        check(other.get_all({"user_id": f"{tag}-x"})["count"] == 0, "tenant B lists tenant A's memories")
        check(results(other.search("secret", {"user_id": f"{tag}-x"})) == [], "tenant B searches tenant A's")
        expect_error(lambda: other.call("get", keep), "not found")
        expect_error(lambda: other.call("delete", keep), "not found")
        check(api.call("get", keep)["memory"] == "Tenant A's secret.", "tenant A lost its memory")
        expect_error(lambda: api.call("get", lisbon), "not found")  # deleted by delete_all above

    # The async twin, same scenario on its own users.
    async def make():
        return AsyncMemoryClient(api_key=key, host=base)

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    ac = loop.run_until_complete(make())
    check(ac.project_id == tenant, f"async ping: project {ac.project_id}")
    scenario(Api(ac, v2, True), f"v{version[0]}-{mode}-async", with_infer=False)

    # reset(): every entity of the tenant goes
    Api(c, v2, False).add("One more memory before the reset.", user_id=f"{tag}-last", infer=False)
    Api(c, v2, False).call("reset")
    check(results(c.users()) == [], "reset left entities")
    print("driver: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
