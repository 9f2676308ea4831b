#!/usr/bin/env python3
"""Two `inferscale serve` nodes on one PostgreSQL store behind HAProxy, all on loopback.

    scripts/pg_temp.sh test_cluster.py INFERSCALE_BINARY MODEL.gguf WORK_DIR HAPROXY_CFG

scripts/pg_temp.sh starts a throwaway PostgreSQL server and sets IS_PG_URL.
This script starts two nodes (`serve --store $IS_PG_URL`, the default model
and embedder, data directories of their own) and HAProxy with the shipped
deploy/haproxy.cfg as it is (addresses from the environment), and drives
them with the official mem0ai (2.2.1) and openai clients, from the virtual
environment test_mem0_client.py makes under WORK_DIR (shared with it):

  1. a fact added through node A is found by a search through node B
     (B's index follows A's change through LISTEN/NOTIFY); B's first chat
     of the user encodes its KV there and injects it (usage.facts.encoded,
     usage.injected_tokens), and B's next chat reads it from B's disk
     (usage.facts.disk): B encoded nothing on hearing of the add;
  2. after the fact is updated through A (to a text of another length),
     B's first answer encodes and injects the new version's KV (never the
     old version's: injected_tokens is the new text's), and so do not
     B's later answers, which read it from disk;
  3. under load through HAProxy (adds, searches and chats of six users, each
     sending X-User-Id), node A is killed with SIGKILL: every add that was
     acknowledged is still there afterwards, A's users are served by B
     (X-Served-By), and the failed requests and the time until A's users
     were served again are counted and printed;
  4. node A starts again on its address: once its health checks pass, its
     users go back to it and node B's users stay on B (a node joining
     moves only its share), and A finds the facts its users added through
     B while it was down.

Exit status 77 (ctest's skip) with the reason when haproxy, PostgreSQL
(IS_PG_URL), the model or PyPI are missing; anything else is a failure.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import test_mem0_client as m0  # noqa: E402  (its venv, Server, check/fail/skip)

check, fail, skip = m0.check, m0.fail, m0.skip
OLD_TEXT = "Alice's favourite colour is teal."
NEW_TEXT = ("Alice's favourite colour changed last winter: it is now a deep crimson red, "
            "the colour of the ripe cherries in her grandmother's garden.")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, headers=None, timeout=5):
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, dict(r.headers), r.read()


def served_by(lb, user):
    _, h, _ = http_get(f"{lb}/health", {"X-User-Id": user})
    return h.get("X-Served-By") or h.get("x-served-by")


def wait_for(what, fn, limit):
    t0 = time.time()
    while time.time() - t0 < limit:
        v = fn()
        if v:
            return v, time.time() - t0
        time.sleep(0.2)
    fail(f"{what}: not within {limit} s")


# ---- the driver (inside the virtual environment) -------------------------------------------

def mem0_client(base, user=None):
    from mem0 import MemoryClient
    c = MemoryClient(api_key="cluster-test", host=base)
    if user:
        c.client.headers["X-User-Id"] = user  # what HAProxy hashes on
    return m0.Api(c, True, False)


def chat(base, user, mode="kv", max_tokens=2):
    import openai
    c = openai.OpenAI(base_url=f"{base}/v1", api_key="cluster-test", max_retries=0, timeout=120,
                      default_headers={"X-User-Id": user})
    r = c.chat.completions.create(model="default", user=user, max_tokens=max_tokens, temperature=0,
                                  messages=[{"role": "user", "content": "What is Alice's favourite colour?"}],
                                  extra_body={"memory": {"k": 3, "mode": mode}})
    return r.model_dump()["usage"]


def scenario_two_nodes(a, b):
    U = "alice-two-nodes"
    api_a, api_b = mem0_client(a.base), mem0_client(b.base)
    r = m0.results(api_a.add(OLD_TEXT, user_id=U, infer=False))
    check(len(r) == 1 and r[0]["memory"] == OLD_TEXT, f"add through A: {r}")
    fid = r[0]["id"]

    def found():
        hits = m0.results(api_b.search("favourite colour", {"user_id": U}, top_k=3))
        return [h for h in hits if h["id"] == fid]
    hits, dt = wait_for("the fact added through A, searched through B", found, 15)
    check(hits[0]["memory"] == OLD_TEXT, f"B found {hits}")
    print(f"1. added through A, found by a search through B after {dt:.2f} s")

    t0 = time.time()
    u_old = chat(b.base, U)
    dt = time.time() - t0
    t_old = u_old["injected_tokens"]
    check(t_old > 0 and u_old["memory_tokens"] == t_old, f"B's first chat did not inject the fact: {u_old}")
    check(u_old["facts"]["encoded"] == 1 and u_old["facts"]["text"] == 0,
          f"B's first chat did not encode the fact on demand: {u_old}")
    u_next = chat(b.base, U)
    check(u_next["facts"]["encoded"] == 0 and u_next["facts"]["disk"] + u_next["facts"]["gpu"] == 1
          and u_next["injected_tokens"] == t_old, f"B's second chat did not read its record: {u_next}")
    print(f"   B's first chat encoded it and injected its {t_old} tokens of KV ({dt:.2f} s); "
          f"the next read it from disk")

    api_a.call("update", fid, text=NEW_TEXT)
    seen, t0, new_inj = [], time.time(), None
    while time.time() - t0 < 90:
        u = chat(b.base, U)
        seen.append((u["memory_tokens"], u["injected_tokens"]))
        check(u["memory_tokens"] != t_old, f"B answered with the old text after the update: {u}")
        check(u["injected_tokens"] in (0, u["memory_tokens"]),
              f"B injected KV that is not the new text's after the update: {u} (old: {t_old} tokens)")
        if u["injected_tokens"] > 0:
            new_inj = u
            break
    check(new_inj is not None, f"B never injected the updated fact's KV: {seen}")
    check(len(seen) == 1 and new_inj["facts"]["encoded"] == 1,
          f"B's first answer after the update did not encode the new version's KV: {seen}, {new_inj}")
    check(len({m for m, _ in seen}) == 1, f"memory tokens changed between answers: {seen}")
    print(f"2. updated through A: {len(seen)} answers of B, all with the new text "
          f"({new_inj['memory_tokens']} tokens, old {t_old}); B injected the new KV after "
          f"{time.time() - t0:.2f} s")


class Load:
    """Adds, searches and chats of a set of users through the load balancer."""

    def __init__(self, lb, users):
        self.lb, self.users = lb, users
        self.acked = {u: [] for u in users}  # texts whose add was acknowledged
        self.log = []  # (user, t_start, t_end, ok, kind)
        self.mu = threading.Lock()
        self.stop = threading.Event()
        self.n = 0

    def worker(self, k):
        apis = {u: mem0_client(self.lb, u) for u in self.users}
        i = 0
        while not self.stop.is_set():
            u = self.users[(k + i) % len(self.users)]
            i += 1
            kind = "chat" if k == 0 and i % 3 == 0 else ("search" if i % 3 == 0 else "add")
            with self.mu:
                self.n += 1
                text = f"{u} noted fact number {self.n}."
            t = time.time()
            ok = True
            try:
                if kind == "add":
                    r = m0.results(apis[u].add(text, user_id=u, infer=False))
                    if len(r) == 1 and r[0]["memory"] == text:
                        with self.mu:
                            self.acked[u].append(text)
                    else:
                        ok = False
                elif kind == "search":
                    m0.results(apis[u].search("noted fact", {"user_id": u}, top_k=3))
                else:
                    chat(self.lb, u, mode="kv", max_tokens=1)
            except Exception:  # noqa: BLE001 - a failed request is counted, not raised
                ok = False
            with self.mu:
                self.log.append((u, t, time.time(), ok, kind))

    def run(self, n_threads):
        self.threads = [threading.Thread(target=self.worker, args=(k,), daemon=True) for k in range(n_threads)]
        for th in self.threads:
            th.start()

    def finish(self):
        self.stop.set()
        for th in self.threads:
            th.join(180)


def scenario_kill(lb, a, b):
    names = {}
    for i in range(64):
        u = f"user-{i}"
        names.setdefault(served_by(lb, u), []).append(u)
        if len(names.get("node1", [])) >= 3 and len(names.get("node2", [])) >= 3:
            break
    check(len(names.get("node1", [])) >= 3 and len(names.get("node2", [])) >= 3,
          f"the hash sent 64 users to {({k: len(v) for k, v in names.items()})}")
    on_a, on_b = names["node1"][:3], names["node2"][:3]
    load = Load(lb, on_a + on_b)
    load.run(4)
    time.sleep(5)
    t_kill = time.time()
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait()
    time.sleep(10)
    load.finish()

    before = [e for e in load.log if e[2] <= t_kill]
    after = [e for e in load.log if e[2] > t_kill]
    check(len(before) > 0 and all(e[3] for e in before),
          f"failures before the kill: {[e for e in before if not e[3]][:5]} of {len(before)}")
    failed = [e for e in after if not e[3]]
    back = [e[2] - t_kill for e in after if e[3] and e[0] in on_a and e[1] >= t_kill]
    check(back, "node A's users were never served again after the kill")
    for u in on_a:
        check(served_by(lb, u) == "node2", f"user {u} of the killed node is not served by node2")
    # No acknowledged add is lost: each is in the store, read through the survivor.
    n_acked = 0
    for u in on_a + on_b:
        stored = {m["memory"] for m in m0.results(mem0_client(lb, u).get_all({"user_id": u}, page=1, page_size=1000))}
        missing = [t for t in load.acked[u] if t not in stored]
        check(not missing, f"{len(missing)} acknowledged adds of {u} are lost, e.g. {missing[:3]}")
        n_acked += len(load.acked[u])
    print(f"3. kill -9 of node A under load ({len(load.log)} requests of 6 users over 4 threads; "
          f"{len(before)} before the kill, all ok): {len(failed)} of {len(after)} requests after it "
          f"failed ({', '.join(sorted({e[4] for e in failed})) or 'none'}); A's users served again "
          f"{min(back):.2f} s after the kill; {n_acked} acknowledged adds, none lost")
    return on_a, on_b, load.acked


def scenario_rejoin(lb, binary, model, embedder, url, port, on_a, on_b, acked):
    t0 = time.time()
    a = m0.Server(binary, model, embedder, ["--store", url, "--no-auth", "--port", str(port)])
    check(a.port == port, f"node A came back on port {a.port}, not {port}")

    def back():
        return all(served_by(lb, u) == "node1" for u in on_a)
    _, dt = wait_for("node A's users moving back to it", back, 30)
    for u in on_b:
        check(served_by(lb, u) == "node2", f"user {u} moved off node2 when node1 came back")
    for u in on_a:
        stored = {m["memory"] for m in m0.results(mem0_client(a.base).get_all({"user_id": u}, page=1, page_size=1000))}
        check(all(t in stored for t in acked[u]), f"node A lacks facts of {u} added through B")
    print(f"4. node A restarted: its {len(on_a)} users back on it {dt:.2f} s after it listened "
          f"({time.time() - t0:.2f} s after the restart), node B's {len(on_b)} users stayed on B")
    return a


def drive(binary, model, cfg):
    url = os.environ["IS_PG_URL"]
    embedder = os.path.join(os.path.dirname(os.path.abspath(model)), "all-MiniLM-L6-v2")
    nodes, lb_proc = [], None
    try:
        for _ in range(2):
            nodes.append(m0.Server(binary, model, embedder, ["--store", url, "--no-auth"]))
        a, b = nodes
        lb_port = free_port()
        env = dict(os.environ, IS_LB_BIND=f"127.0.0.1:{lb_port}", IS_NODE1=f"127.0.0.1:{a.port}",
                   IS_NODE2=f"127.0.0.1:{b.port}")
        lb_proc = subprocess.Popen(["haproxy", "-db", "-f", cfg], env=env, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        lb = f"http://127.0.0.1:{lb_port}"

        def lb_up():
            try:
                return http_get(f"{lb}/health")[0] == 200
            except Exception:  # noqa: BLE001 - not listening yet
                return False
        wait_for("haproxy", lb_up, 20)
        scenario_two_nodes(a, b)
        on_a, on_b, acked = scenario_kill(lb, a, b)
        nodes.append(scenario_rejoin(lb, binary, model, embedder, url, a.port, on_a, on_b, acked))
    finally:
        if lb_proc:
            lb_proc.terminate()
            lb_proc.wait(10)
        for n in nodes:
            n.stop()
    print("PASS")
    return 0


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "--drive":
        return drive(*sys.argv[2:5])
    if len(sys.argv) != 5:
        fail("usage: scripts/pg_temp.sh test_cluster.py INFERSCALE_BINARY MODEL.gguf WORK_DIR HAPROXY_CFG")
    binary, model, work, cfg = sys.argv[1:5]
    if not os.environ.get("IS_PG_URL"):
        skip("IS_PG_URL is not set: run under scripts/pg_temp.sh (PostgreSQL in a temporary directory)")
    if not shutil.which("haproxy"):
        skip("haproxy not found (apt-get install haproxy; scripts/setup.sh installs it)")
    if not os.path.isfile(model):
        skip(f"model {model} not found (scripts/setup.sh installs it)")
    if not os.path.isdir(os.path.join(os.path.dirname(os.path.abspath(model)), "all-MiniLM-L6-v2")):
        skip("the embedding model all-MiniLM-L6-v2 is not beside the model (scripts/setup.sh installs it)")
    os.makedirs(work, exist_ok=True)
    py, _ = m0.make_venv(work)
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        os.environ.pop(k, None)
    home = tempfile.mkdtemp(prefix="test_cluster_home_")
    env = dict(os.environ, NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost",
               MEM0_TELEMETRY="False", HOME=home, MEM0_DIR=os.path.join(home, ".mem0"),
               PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONPATH", None)
    try:
        r = subprocess.run([py, os.path.abspath(__file__), "--drive", binary, model, cfg], env=env)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
