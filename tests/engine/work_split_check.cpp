// A check of work_split.h's stealing, called by test_work_split.py. `threads` threads run `epochs`
// epochs of three phases of `items` items each in one parallel region, shaped as decode_forward.cpp's
// layers: the epochs alternate between two sets of buffers A, B, C; phase a reads the C of the epoch
// before and writes A, phase b reads A and writes B, phase c reads B and writes C, each item i adding
// one to item i of its input. The thread that takes item 0 of the phase named by `stall_phase` (0-2)
// of epoch 1 sleeps `stall_us` in the middle of it, as a thread the OS took away mid-item: the other
// threads take its run over and go on without it, and it finishes that one item late.
//
// Returns the reads of phases b and c that found their input unfinished (late ones included: they read
// their own epoch's buffers, which nobody rewrites before the late thread has let go) plus the items of
// the last two epochs' buffers that do not hold their values at the end; through `stolen` the runs
// taken over.

#include "work_split.h"

#include <omp.h>
#include <unistd.h>

#include <vector>

namespace {
using Buffer = std::vector<std::atomic<int64_t>>;
}

extern "C" int64_t strata_check_stealing(int threads, int64_t items, int64_t epochs, int64_t stall_phase,
                                         int64_t stall_us, int64_t* stolen) {
  Buffer sets[2][3] = {{Buffer(items), Buffer(items), Buffer(items)}, {Buffer(items), Buffer(items), Buffer(items)}};
  std::atomic<int64_t> wrong{0};
  std::atomic<bool> stalled{false};
  PhaseCounters counters(3 * epochs, threads, epochs);
#pragma omp parallel num_threads(threads)
  {
    ProgressSplit split(counters, omp_get_thread_num());
    for (int64_t e = 0; e < epochs; ++e) {
      split.begin_epoch(e);
      Buffer* now = sets[e % 2];
      const Buffer& before = sets[(e + 1) % 2][2];
      for (int phase = 0; phase < 3; ++phase) {
        const Buffer& in = phase == 0 ? before : now[phase - 1];
        const int64_t expected = 3 * e + phase;  // what `in` holds once the phase before is over
        split.items(items, 2, [&](int64_t i) {
          const int64_t value = e == 0 && phase == 0 ? 0 : in[i].load();
          if (phase > 0) wrong += value != expected;
          if (e == 1 && phase == stall_phase && i == 0 && !stalled.exchange(true))
            usleep(stall_us);
          now[phase][i].store(value + 1);
        });
      }
    }
  }
  for (int64_t e = epochs - 2; e < epochs; ++e)  // what the last two epochs wrote, still there
    for (int phase = 0; phase < 3; ++phase)
      for (int64_t i = 0; i < items; ++i) wrong += sets[e % 2][phase][i].load() != 3 * e + phase + 1;
  *stolen = counters.stolen_runs().load();
  return wrong.load();
}
