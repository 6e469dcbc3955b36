"""Deadlock and buffer-race model of swapped-roles.patch's barrier protocol (run: python3 FILE).

Each warpgroup is one actor running its sequence of named-barrier syncs and arrivals, page
waits and releases (a 2-stage TMA ring), and buffer writes and reads. A named barrier completes
when both warpgroups (2 x 128 threads) have arrived. Random interleavings for 0-8 pages must
finish with every read seeing the page its buffer should hold. Removing the S-buffer barriers
makes it report a race. The V^T-free barrier turns out redundant: WG1 arrives at kSFreeBarrier
only after its PV of the page before.
"""
import itertools, random

def wg1(n):
    ops = []
    for i in range(n):
        ops += [("sync", "SReady"), ("read", "S", i)]
        if i + 1 < n: ops += [("arrive", "SFree")]
        ops += [("wait_page", i), ("release", i), ("write", "H%d" % (i % 2), i), ("sync", "Page"),
                ("read", "VT%d" % (i % 2), i), ("read", "H%d" % (i % 2), i)]
        if i + 2 < n: ops += [("arrive", "VtFree%d" % (i % 2))]
    ops += [("sync", "Page")]
    return ops

def wg2(n):
    ops = []
    def page(i):
        o = [("wait_page", i)]
        if i >= 1: o += [("sync", "SFree")]
        o += [("write", "S", i), ("arrive", "SReady")]
        if i >= 2: o += [("sync", "VtFree%d" % (i % 2))]
        o += [("write", "VT%d" % (i % 2), i), ("release", i)]
        return o
    if n > 0: ops += page(0)
    for i in range(n):
        if i + 1 < n: ops += page(i + 1)
        ops += [("sync", "Page"), ("read", "H%d" % (i % 2), i), ("read", "VT%d" % (i % 2), i)]
    ops += [("sync", "Page")]
    return ops

def run(n, seed):
    rng = random.Random(seed)
    progs = [wg1(n), wg2(n)]
    pc = [0, 0]
    arrived = {}          # barrier -> arrivals in the current generation
    gen = {}              # barrier -> completed generations
    waiting = [None, None]  # (barrier, generation awaited)
    released = {}         # page -> count of warpgroups that released it
    loaded = set()
    content = {}          # buffer -> page written there last
    stages = 2
    def producer():
        for j in range(n):
            if j in loaded: continue
            if j >= stages and released.get(j - stages, 0) < 2: return
            loaded.add(j)
    steps = 0
    while pc[0] < len(progs[0]) or pc[1] < len(progs[1]):
        producer()
        runnable = []
        for w in (0, 1):
            if pc[w] >= len(progs[w]): continue
            if waiting[w] is not None:
                b, g = waiting[w]
                if gen.get(b, 0) > g: waiting[w] = None; pc[w] += 1; runnable.append(w); continue
                continue
            op = progs[w][pc[w]]
            if op[0] == "wait_page" and op[1] not in loaded: continue
            runnable.append(w)
        runnable = [w for w in runnable if waiting[w] is None and pc[w] < len(progs[w])]
        if not runnable:
            if all(pc[w] >= len(progs[w]) for w in (0, 1)): break
            return "deadlock at %s" % ([progs[w][pc[w]] if pc[w] < len(progs[w]) else None for w in (0, 1)])
        w = rng.choice(runnable)
        op = progs[w][pc[w]]
        kind = op[0]
        if kind in ("sync", "arrive"):
            b = op[1]
            arrived[b] = arrived.get(b, 0) + 1
            g = gen.get(b, 0)
            if arrived[b] == 2:
                arrived[b] = 0; gen[b] = g + 1
            if kind == "sync":
                waiting[w] = (b, g)
                continue
        elif kind == "write":
            content[op[1]] = op[2]
        elif kind == "read":
            if content.get(op[1]) != op[2]:
                return "race: WG%d reads %s for page %d, holds page %s" % (w + 1, op[1], op[2], content.get(op[1]))
        elif kind == "release":
            released[op[1]] = released.get(op[1], 0) + 1
        pc[w] += 1
        steps += 1
    return "ok"

bad = 0
for n in range(0, 9):
    for seed in range(300):
        r = run(n, seed)
        if r != "ok":
            print(n, seed, r); bad += 1; break
print("failures:", bad)
