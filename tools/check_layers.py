#!/usr/bin/env python3
"""check_layers: the include graph keeps DESIGN.md's layers.

Layers, lowest first (a file may include its own layer and the ones below it):

  api (include/inferscale.h: the public types and status codes, which every
       layer returns; it includes no internal header)
  < core < gguf < backend (src/backend, src/backend/cpu, cuda/)
  < model < kv < engine < memory < serve (src/serve, src/serve/http)
  < eval, tools

The backends sit below the model: a model is its weights placed on a backend
(model.h holds backend_weight pointers), and the backend interface speaks in
GGUF tensor types, not in models. DESIGN.md's diagram draws it so.

Checked, over every #include "..." of src/, cuda/, include/ and tools/:
  1. no upward edge: a file never includes a header of a higher layer;
  2. no cycle between folders (src/serve/http -> src/serve -> src/serve/http
     is a cycle even though both are the serve layer);
  3. backend implementations are private: only src/backend (the interface,
     which creates a backend by name) includes a header of cuda/ or
     src/backend/cpu/ from outside them;
  4. no cycle between the libraries that CMakeLists.txt files link
     (target_link_libraries between add_library targets, INTERFACE ones
     included, so a cycle through inferscale_internal counts too).

Edges that exist today and are known debt are listed in KNOWN_DEBT below, each
with why it is there: they are reported but do not fail, so only a NEW upward
edge or cycle fails the check. An entry that no longer occurs is reported too
(delete it, so that the debt cannot come back unnoticed).

usage: tools/check_layers.py [ROOT]      exit 0 clean, 1 on a violation
       tools/check_layers.py --self-test  the check fails on a made-up tree
                                          with an upward edge and a cycle
"""
import os
import re
import sys

LAYERS = [
    ("api", ["include"]),
    ("core", ["src/core"]),
    ("gguf", ["src/gguf"]),
    ("backend", ["src/backend", "cuda"]),
    ("model", ["src/model"]),
    ("kv", ["src/kv"]),
    ("engine", ["src/engine"]),
    ("memory", ["src/memory"]),
    ("serve", ["src/serve"]),
    ("top", ["src/eval", "tools"]),
]

# Known debt: (from folder, to folder) edges, or ("lib", A, B) library links,
# that break the rules today. Each names its reason; the fix is a change of
# design, not of this list.
KNOWN_DEBT = {
}

SOURCE_DIRS = ["src", "cuda", "include", "tools"]
# Backend implementations, and the one folder allowed to include them.
PRIVATE_IMPLS = ["cuda", "src/backend/cpu"]
IMPL_REGISTRY = "src/backend"
EXTS = (".c", ".h", ".cu", ".cuh")
INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def folder_of(rel):
    return os.path.dirname(rel)


def layer_of(folder):
    """(rank, name) of the layer holding `folder`, or None outside the layers."""
    for rank, (name, roots) in enumerate(LAYERS):
        for r in roots:
            if folder == r or folder.startswith(r + "/"):
                return rank, name
    return None


def resolve(root, src_rel, inc):
    """The repository path an #include "inc" of src_rel names, or None when it
    is a system header or a generated file. Search order as the build has it:
    the including file's folder, src/, include/, cuda/."""
    cands = [os.path.join(os.path.dirname(src_rel), inc), os.path.join("src", inc),
             os.path.join("include", inc), os.path.join("cuda", inc)]
    for c in cands:
        c = os.path.normpath(c)
        if os.path.isfile(os.path.join(root, c)):
            return c
    return None


def include_edges(root):
    edges = []  # (from file, to file)
    for d in SOURCE_DIRS:
        for dirpath, _, files in os.walk(os.path.join(root, d)):
            for f in sorted(files):
                if not f.endswith(EXTS):
                    continue
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, root)
                with open(path, errors="replace") as fh:
                    text = fh.read()
                for inc in INCLUDE_RE.findall(text):
                    to = resolve(root, rel, inc)
                    if to is not None:
                        edges.append((rel, to))
    return edges


def library_edges(root):
    """(A, B) for target_link_libraries(A ... B ...) where both are
    add_library targets of the project's CMakeLists.txt files."""
    libs, links = set(), []
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if not x.startswith(".") and not x.startswith("build")]
        if "CMakeLists.txt" not in files:
            continue
        with open(os.path.join(dirpath, "CMakeLists.txt")) as fh:
            text = re.sub(r"#[^\n]*", "", fh.read())
        libs.update(re.findall(r"add_library\(\s*([A-Za-z0-9_.+-]+)\s+(?:STATIC|SHARED|OBJECT|INTERFACE)", text))
        for m in re.finditer(r"target_link_libraries\(\s*([A-Za-z0-9_.+-]+)([^)]*)\)", text):
            for tok in m.group(2).split():
                links.append((m.group(1), tok))
    return sorted({(a, b) for a, b in links if a in libs and b in libs and a != b})


def cycles(edges):
    """Strongly connected components of more than one node (Tarjan)."""
    graph = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def self_test():
    """Runs the check on small trees made here: a clean one must pass, and
    one new upward edge, one new folder cycle, one new private include and one
    new library cycle must each fail. So a check that passes on the real tree
    is known to be able to fail."""
    import contextlib
    import io
    import tempfile

    base = {
        "include/inferscale.h": "",
        "src/core/status.h": '#include "inferscale.h"\n',
        "src/gguf/gguf.h": '#include "core/status.h"\n',
        "src/backend/backend.h": '#include "gguf/gguf.h"\n',
        "src/backend/backend.c": '#include "backend/backend.h"\n#include "backend_cuda.h"\n',
        "cuda/backend_cuda.h": '#include "backend/backend.h"\n',
        "src/model/model.h": '#include "backend/backend.h"\n',
        "src/engine/engine.h": '#include "model/model.h"\n',
        "src/serve/scheduler.h": '#include "engine/engine.h"\n',
        "CMakeLists.txt": "add_library(a STATIC x.c)\nadd_library(b STATIC y.c)\ntarget_link_libraries(a PUBLIC b)\n",
    }
    cases = [
        ("clean", {}, 0),
        ("upward", {"src/gguf/gguf.c": '#include "engine/engine.h"\n'}, 1),
        ("cycle", {"src/serve/http/app.h": '#include "serve/scheduler.h"\n',
                   "src/serve/ask.h": '#include "serve/http/app.h"\n'}, 1),
        ("private", {"src/serve/x.c": '#include "backend_cuda.h"\n'}, 1),
        ("library", {"cuda/CMakeLists.txt": "target_link_libraries(b PUBLIC a)\n"}, 1),
        ("not a library", {"tools/CMakeLists.txt": "target_link_libraries(a-cli PRIVATE b)\n"
                                         "add_library(b2 STATIC z.c)\ntarget_link_libraries(b PUBLIC b2)\n"}, 0),
        ("library via interface", {"cuda/CMakeLists.txt": "add_library(i INTERFACE)\n"
                                   "target_link_libraries(i INTERFACE a)\n"
                                   "target_link_libraries(b PUBLIC i)\n"}, 1),
    ]
    ok = True
    for name, extra, want in cases:
        with tempfile.TemporaryDirectory() as d:
            for rel, text in {**base, **extra}.items():
                os.makedirs(os.path.join(d, os.path.dirname(rel)), exist_ok=True)
                with open(os.path.join(d, rel), "w") as f:
                    f.write(text)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                got = check(d, debt={})
            status = "ok" if got == want else "WRONG"
            ok = ok and got == want
            print(f"self-test {name}: exit {got}, want {want}: {status}")
            if got != want:
                print(out.getvalue())
    return 0 if ok else 1


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--self-test":
        return self_test()
    if len(sys.argv) > 1 and sys.argv[1].startswith("-"):
        print(__doc__)
        return 0 if sys.argv[1] in ("-h", "--help") else 2
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    return check(root, KNOWN_DEBT)


def check(root, debt):
    KNOWN_DEBT = debt
    bad, used = [], set()

    files = include_edges(root)
    folder_edges = {}
    for a, b in files:
        fa, fb = folder_of(a), folder_of(b)
        if fa != fb:
            folder_edges.setdefault((fa, fb), []).append(f"{a} -> {b}")

    # 1. Upward edges.
    for (fa, fb), why in sorted(folder_edges.items()):
        la, lb = layer_of(fa), layer_of(fb)
        if la is None or lb is None or lb[0] <= la[0]:
            continue
        if (fa, fb) in KNOWN_DEBT:
            used.add((fa, fb))
            print(f"known debt: {fa} ({la[1]}) -> {fb} ({lb[1]}): {KNOWN_DEBT[(fa, fb)]} [{why[0]}]")
            continue
        bad.append(f"upward include {fa} ({la[1]}) -> {fb} ({lb[1]}): " + "; ".join(why))

    # 2. Private backend headers used from outside the backends.
    for (fa, fb), why in sorted(folder_edges.items()):
        if fb not in PRIVATE_IMPLS or fa == IMPL_REGISTRY or fa in PRIVATE_IMPLS:
            continue
        if (fa, fb) in KNOWN_DEBT:
            used.add((fa, fb))
            print(f"known debt: {fa} -> {fb} (a backend's private header): {KNOWN_DEBT[(fa, fb)]}")
            continue
        bad.append(f"backend-private include {fa} -> {fb}: " + "; ".join(why))

    # 3. Folder cycles: an edge inside a cycle is a violation unless it is
    # known debt (removing the debt edges must leave no cycle).
    # The backend interface creates its implementations by name and they
    # implement it: that pair of edges is the design, not a cycle to break.
    registry = {(IMPL_REGISTRY, i) for i in PRIVATE_IMPLS} | {(i, IMPL_REGISTRY) for i in PRIVATE_IMPLS}
    live = [e for e in folder_edges if e not in KNOWN_DEBT and e not in registry]
    for e in folder_edges:
        if e in KNOWN_DEBT:
            used.add(e)
    for comp in cycles(live):
        inner = [f"{a} -> {b} ({folder_edges[(a, b)][0]})" for (a, b) in live if a in comp and b in comp]
        bad.append("include cycle between folders " + ", ".join(comp) + ": " + "; ".join(inner))
    for comp in cycles([e for e in folder_edges if e not in registry]):
        debt = [e for e in folder_edges if e in KNOWN_DEBT and e[0] in comp and e[1] in comp]
        print("known debt: include cycle " + " <-> ".join(comp) + ", broken only by the debt edges "
              + ", ".join(f"{a} -> {b}" for a, b in debt))

    # 4. Library cycles.
    libs = library_edges(root)
    live = []
    for a, b in libs:
        key = ("lib",) + tuple(sorted((a, b)))
        if key in KNOWN_DEBT:
            used.add(key)
        else:
            live.append((a, b))
    for comp in cycles(live):
        bad.append("library cycle: " + " <-> ".join(comp) + " (links: "
                   + ", ".join(f"{a} -> {b}" for a, b in live if a in comp and b in comp) + ")")
    for key in sorted(k for k in KNOWN_DEBT if k[0] == "lib" and k in used):
        print(f"known debt: library link {key[1]} <-> {key[2]}: {KNOWN_DEBT[key]}")

    for key in sorted(set(KNOWN_DEBT) - used, key=str):
        print(f"check_layers: known debt {key} no longer occurs: remove it from KNOWN_DEBT")
        bad.append(f"stale known-debt entry {key}")

    n_up = sum(1 for (fa, fb) in folder_edges if layer_of(fa) and layer_of(fb))
    if bad:
        for b in bad:
            print("check_layers: FAIL: " + b)
        return 1
    print(f"check_layers: {len(files)} includes, {n_up} folder edges, {len(libs)} library links: "
          f"no upward edge or cycle beyond the {len(used)} known-debt entries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
