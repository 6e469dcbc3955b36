"""The split planner's C++ (csrc/split_kv.h ``plan_splits``, what every decode launch runs on the
GPU) against its Python model (``vllm_snapmla.kernels.splits.pages_per_split_for``), on the host:
``plan_splits`` is a template over the warp, so the probe below runs it with 32 threads for the
lanes and a barrier-backed shuffle.  The GPU test ``test_planner_matches_its_python_model`` runs
the launch itself; this one runs hundreds of shapes in CI, where no GPU is."""

import random
import subprocess

import pytest

from tests.unit.kernels.host_probe import build_probe
from vllm_snapmla.kernels import sm90, splits

# Reads cases "table_pages batch programs slots max_splits overhead len..." from stdin, one a
# line, and prints each plan; a line "M batch programs slots table_pages" prints the grid's
# max_splits_for instead, a line "R seq_len table_pages plan max_splits split" one split's
# split_range.  A shuffle is two rounds of a 32-thread barrier: every lane posts
# its value, then reads its partner's.
_PROBE = r"""
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "split_kv.h"

class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void wait() {
    std::unique_lock<std::mutex> lock(m_);
    const long gen = gen_;
    if (++count_ == n_) {
      count_ = 0;
      ++gen_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return gen_ != gen; });
    }
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  int n_, count_ = 0;
  long gen_ = 0;
};

struct Exchange {
  Barrier barrier{32};
  unsigned long long slot[32];
};

struct HostWarp {
  int lane;
  Exchange* x;
  template <typename T>
  T xor_shuffle(T v, int offset) const {
    static_assert(sizeof(T) <= sizeof(unsigned long long), "one slot per lane");
    unsigned long long bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    x->slot[lane] = bits;
    x->barrier.wait();
    const unsigned long long other = x->slot[lane ^ offset];
    x->barrier.wait();
    T out;
    std::memcpy(&out, &other, sizeof(T));
    return out;
  }
};

int main() {
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    if (!line.empty() && line[0] == 'R') {   // "R seq_len table_pages plan max_splits split"
      char tag;
      int seq_len, table_pages, plan, max_splits, split;
      in >> tag >> seq_len >> table_pages >> plan >> max_splits >> split;
      const snapmla::SplitRange r =
          snapmla::split_range(seq_len, table_pages, plan, max_splits, split);
      std::printf("%d %d %d\n", r.first_page, r.num_pages, r.num_splits);
      continue;
    }
    if (!line.empty() && line[0] == 'M') {   // "M batch programs slots table_pages": the grid
      char tag;
      long long batch, programs, table_pages;
      int slots;
      in >> tag >> batch >> programs >> slots >> table_pages;
      std::printf("%d\n", snapmla::max_splits_for(batch, programs, slots, table_pages));
      continue;
    }
    snapmla::SplitPlanParams p{};
    std::vector<int32_t> lens;
    in >> p.table_pages >> p.batch >> p.programs >> p.slots >> p.max_splits >> p.overhead_pages;
    for (int32_t v; in >> v;) lens.push_back(v);
    p.seq_lens = lens.data();
    Exchange x;
    int plans[32];
    std::vector<std::thread> lanes;
    for (int lane = 0; lane < 32; ++lane) {
      lanes.emplace_back([&, lane] { plans[lane] = snapmla::plan_splits(p, HostWarp{lane, &x}); });
    }
    for (auto& t : lanes) t.join();
    for (int lane = 1; lane < 32; ++lane) {
      if (plans[lane] != plans[0]) {
        std::printf("lanes disagree\n");
        return 1;
      }
    }
    std::printf("%d\n", plans[0]);
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def planner(tmp_path_factory):
    """Runs the C++ planner on a list of cases, returning its plans."""
    probe = build_probe(tmp_path_factory, "split_planner", _PROBE, "csrc/split_kv.h")

    def answers(lines, timeout):
        out = subprocess.run([str(probe)], input="".join(lines), capture_output=True, text=True,
                             timeout=timeout)
        assert out.returncode == 0, out.stdout[-500:] + out.stderr[-500:]
        return [int(v) for v in out.stdout.split()]

    def run(cases):
        return answers([" ".join(map(str, [tp, len(lens), programs, slots, max_splits,
                                           splits.SPLIT_OVERHEAD_PAGES, *lens])) + "\n"
                        for tp, lens, programs, slots, max_splits in cases], timeout=600)

    def grids(cases):
        return answers([f"M {batch} {programs} {slots} {table_pages}\n"
                        for batch, programs, slots, table_pages in cases], timeout=60)
    def ranges(cases):
        values = answers([f"R {' '.join(map(str, case))}\n" for case in cases], timeout=60)
        return [tuple(values[i:i + 3]) for i in range(0, len(values), 3)]
    run.grids = grids
    run.ranges = ranges
    return run


def _random_cases(rng, n):
    """Shapes as the decode launches them (max_splits from max_splits_for, one or a few row
    blocks, the H200's 132 SMs and others) and as tests force them; lengths uniform, ragged,
    with empty and invalid requests and lengths past the table."""
    cases = []
    for _ in range(n):
        batch = rng.choice([1, 2, 3, 4, 8, 16, 31, 32, 33, 64, 100, 131, 200])
        row_blocks = rng.choice([1, 1, 2, 4])
        slots = rng.choice([132, 132, 114, 78, 264])
        table_pages = rng.choice([8, 64, 512, 2048, 2560])
        programs = batch * row_blocks
        max_splits = (splits.max_splits_for(batch, programs, slots, table_pages)
                      if rng.random() < 0.7 else rng.randint(1, 300))
        top = table_pages * 64
        kind = rng.random()
        if kind < 0.3:
            lens = [rng.randint(1, top)] * batch
        else:
            lens = [rng.randint(0, top) for _ in range(batch)]
        if kind > 0.8 and batch > 2:
            lens[0] = 0
            lens[1] = -rng.randint(1, 100)
            lens[2] = top + rng.randint(1, 100)
        cases.append((table_pages, lens, programs, slots, max_splits))
    return cases


def test_the_cpp_planner_matches_its_python_model(planner):
    rng = random.Random(7)
    cases = _random_cases(rng, 400)
    cases += [(2048, [0] * 5, 5, 132, 8), (64, [64 * 64], 1, 132, 64), (2560, [1], 1, 132, 132),
              (2560, [131072] * 4, 8, 132, 33), (512, [32768] + [4096] * 15, 32, 132, 9)]
    got = planner(cases)
    want = [splits.pages_per_split_for(lens, programs, slots, max_splits, tp)
            for tp, lens, programs, slots, max_splits in cases]
    mismatches = [(case, g, w) for case, g, w in zip(cases, got, want) if g != w]
    if mismatches:
        (table_pages, lens, programs, slots, max_splits), g, w = mismatches[0]
        pytest.fail(f"{len(mismatches)} of {len(cases)} plans differ; first: C++ {g}, Python {w} "
                    f"for table_pages={table_pages}, programs={programs}, slots={slots}, "
                    f"max_splits={max_splits}, lengths={lens[:8]}{'...' if len(lens) > 8 else ''}")
    assert len(set(want)) > 20   # the cases reach many different plans


def test_the_cpp_grid_matches_its_python_model(planner):
    """``max_splits_for``: two waves for several requests, one for a single request, capped by
    the table's pages and 65535, at least 1; C++ and Python alike."""
    cases = [(batch, programs, slots, table_pages)
             for batch in (0, 1, 2, 3, 64, 1000, 70000)
             for programs in (batch, 2 * batch, 4 * batch, 1, 0, -1)
             for slots in (1, 78, 114, 132, 264)
             for table_pages in (1, 16, 2560, 200000, 2**31 // 64 - 1)]
    got = planner.grids(cases)
    want = [splits.max_splits_for(*case) for case in cases]
    assert got == want
    assert splits.max_splits_for(1, 1, 132, 2560) == 132      # one request: one wave
    assert splits.max_splits_for(2, 2, 132, 2560) == 132      # two: two waves
    assert splits.max_splits_for(1, 2, 132, 2560) == 66       # one request, two row blocks


def test_the_planner_charges_the_combine(planner, monkeypatch):
    """One long request is cut into as many runs as the wide combine merges in one round trip
    (32), not into one run per SM; with the one-warp combine (a launch of fewer than 32 splits)
    a run of one page is not worth its split; long requests keep their cut (the pages
    dominate)."""
    def case(batch, heads, tokens):
        return (2560, [tokens] * batch, sm90.launch_programs(batch, heads), 132,
                sm90.launch_max_splits(batch, heads, 2560, 132))

    # The term itself: nothing for one run; 2 pages, plus 3 per 32 splits (wide, from 32 splits
    # a launch) or 1 per 2 splits (one warp a row).
    assert [splits.combine_cost_pages(runs, 132) for runs in (1, 2, 32, 33, 64, 128)] == \
        [0, 5, 5, 8, 8, 14]
    assert [splits.combine_cost_pages(runs, 31) for runs in (1, 2, 3, 16, 31)] == \
        [0, 3, 4, 10, 18]
    assert splits.combine_cost_pages(32, 32) == 5 and splits.combine_cost_pages(31, 31) == 18

    cases = [case(1, 16, 8192), case(1, 128, 8192), case(1, 16, 4096), case(16, 16, 512),
             case(1, 16, 32768), case(16, 16, 1024), case(1, 16, 131072), case(1, 128, 131072),
             case(8, 128, 2048)]

    def model():
        return [splits.pages_per_split_for(lens, programs, slots, max_splits, tp)
                for tp, lens, programs, slots, max_splits in cases]

    def brute_force():
        """The docstring's cost, evaluated for every candidate run length (not only those of
        the model's loop over split counts): the cheapest run, the longer on ties."""
        best = []
        for tp, lens, programs, slots, max_splits in cases:
            pages = [-(-n // 64) for n in lens]
            top = max(pages)
            def cost(run):
                work = programs * (sum(pages) + sum(-(-p // run) for p in pages) * 2)
                wave = len(pages) * slots * (run + 2)
                return (-(-work // wave) * (run + 2)
                        + splits.combine_cost_pages(-(-top // run), max_splits))
            runs = [r for r in range(1, top + 1) if -(-top // r) <= max_splits]
            best.append(min(runs, key=lambda r: (cost(r), -r)))
        return best

    # The cuts docs/decode-kernels.md states (1 x 16 x 8,192: 32 runs of 4 pages; 16 x 16 x 512:
    # 4 runs of 2 pages; ...), and the cost formula's own minimum.
    assert model() == [4, 4, 2, 2, 8, 4, 16, 32, 4]
    assert model() == brute_force()
    assert planner(cases) == model()
    with_term = model()
    # Without the combine's cost the first six took shorter runs, and none a longer one.
    monkeypatch.setattr(splits, "combine_cost_pages", lambda runs, max_splits: 0)
    assert model() == [1, 2, 1, 1, 4, 2, 16, 32, 4]
    assert model() == brute_force()
    assert all(a <= b for a, b in zip(model(), with_term))


def test_any_plan_cuts_a_request_into_its_pages_exactly(planner):
    """Whatever ``pages_per_split`` a decode is given (``ops.plan_decode`` for other lengths, any
    int32), the splits of its grid cover each of a request's pages once, in at most max_splits
    runs, without int overflow (the grid keeps max_splits x table pages an int): C++ and Python
    alike."""
    int_max = 2**31 - 1
    cases, expected = [], []
    for seq_len, table_pages in ((0, 8), (1, 8), (64 * 7 + 5, 8), (131072, 2560),
                                 (int_max // 64 * 64, int_max // 64)):
        pages = splits.request_pages(seq_len, table_pages)
        for plan in (-(2**31), -5, 0, 1, 3, 64, pages - 1, pages, pages + 1, 1 << 30, int_max):
            for max_splits in (1, 7, 132, 65535):
                if max_splits * table_pages > 2**31 - 1:
                    continue   # no grid has this many splits (max_splits_for)
                end = 0   # the splits' pages in order: each starts where the last ended
                for split in range(min(max_splits, 140)):
                    first, n, runs = splits.split_range(seq_len, table_pages, plan, max_splits,
                                                        split)
                    assert 1 <= runs <= max_splits and 0 <= n and (n == 0 or split < runs)
                    if n:
                        assert first == end, (seq_len, plan, max_splits, split)
                        end = first + n
                    cases.append((seq_len, table_pages, plan, max_splits, split))
                    expected.append((first, n, runs))
                if max_splits <= 140:
                    assert end == pages, (seq_len, plan, max_splits)
    # The int32 edge: the last split of the widest grids (a table of 32768 pages and 65535
    # splits; the widest table, whose grid max_splits_for caps at 64 splits) under plans at and
    # past the request's pages.
    for seq_len, table_pages, max_splits in ((2**21, 2**15, 65535),
                                             (int_max // 64 * 64, int_max // 64, 64)):
        assert max_splits * table_pages <= int_max
        pages = splits.request_pages(seq_len, table_pages)
        for plan in (0, 1, pages // max_splits + 1, pages, int_max):
            for split in (0, 1, max_splits - 2, max_splits - 1):
                first, n, runs = splits.split_range(seq_len, table_pages, plan, max_splits,
                                                    split)
                assert (n == 0 or first + n <= pages) and first <= int_max
                assert 1 <= runs <= max_splits
                cases.append((seq_len, table_pages, plan, max_splits, split))
                expected.append((first, n, runs))
    assert splits.max_splits_for(1, 1, 132, int_max // 64) == 64
    assert planner.ranges(cases) == expected
