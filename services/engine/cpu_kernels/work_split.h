// How the threads of a parallel region share the items of each phase (the panels of a projection, the
// chunks of attention, the rows of a norm), and when a phase is over.
//
// OmpSplit is OpenMP's worksharing loop: a phase ends when every thread has arrived at its barrier.
// On a core shared with other processes (the gateway and tokenizer of the same machine, a neighbour),
// the OS takes a thread away for milliseconds at a time, and at the next barrier every other thread
// waits for it, even though the items it would have taken were long done by the others; a decode step
// has about 15 phases per layer.
//
// ProgressSplit ends a phase when its last item is done: a thread that the OS took away between items
// holds nobody up, and when it runs again it finds the phases it missed done and catches up. Only an
// item it holds when taken away is waited for, so items are kept short. Every thread runs the same
// sequence of phases; each phase has its own pair of counters, in an array the region shares.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define STRATA_PAUSE() _mm_pause()
#else
#define STRATA_PAUSE() ((void)0)
#endif

namespace {

struct OmpSplit {
  // f(i) for i in [0, n), handed out `grab` at a time; ends with the threads' barrier.
  template <typename F>
  void items(int64_t n, int64_t grab, F&& f) {
#pragma omp for schedule(dynamic, grab)
    for (int64_t i = 0; i < n; ++i) f(i);
  }
  // f() by one thread; the others wait for it.
  template <typename F>
  void once(F&& f) {
#pragma omp single
    f();
  }
};

struct alignas(64) PhaseCounter {
  std::atomic<int64_t> next{0};             // the first item not handed out yet
  alignas(64) std::atomic<int64_t> done{0};  // items finished
};

// Phase counters for one run of a parallel region (zeroed: create one per run).
class PhaseCounters {
 public:
  explicit PhaseCounters(size_t phases) : counters_(phases) {}
  PhaseCounter& at(size_t phase) {
    if (phase >= counters_.size()) {  // a caller sized it for fewer phases than it runs: a bug
      std::fprintf(stderr, "strata: PhaseCounters sized for %zu phases, phase %zu asked\n", counters_.size(), phase);
      std::abort();
    }
    return counters_[phase];
  }

 private:
  std::vector<PhaseCounter> counters_;
};

// One per thread, inside the region, over the region's shared PhaseCounters.
class ProgressSplit {
 public:
  explicit ProgressSplit(PhaseCounters& counters) : counters_(counters) {}

  template <typename F>
  void items(int64_t n, int64_t grab, F&& f) {
    PhaseCounter& c = counters_.at(phase_++);
    for (;;) {
      const int64_t first = c.next.fetch_add(grab, std::memory_order_relaxed);
      if (first >= n) break;
      const int64_t last = std::min(n, first + grab);
      for (int64_t i = first; i < last; ++i) f(i);
      c.done.fetch_add(last - first, std::memory_order_release);
    }
    wait_for(c, n);
  }

  // As items, with f(i, next): `next` the item this thread runs after i, or -1 when none. The next run
  // of items is claimed before the last item of the current one runs, so that f can prefetch for it.
  template <typename F>
  void items_ahead(int64_t n, int64_t grab, F&& f) {
    PhaseCounter& c = counters_.at(phase_++);
    int64_t first = c.next.fetch_add(grab, std::memory_order_relaxed);
    while (first < n) {
      const int64_t last = std::min(n, first + grab);
      for (int64_t i = first; i + 1 < last; ++i) f(i, i + 1);
      const int64_t following = c.next.fetch_add(grab, std::memory_order_relaxed);
      f(last - 1, following < n ? following : -1);
      c.done.fetch_add(last - first, std::memory_order_release);
      first = following;
    }
    wait_for(c, n);
  }

  template <typename F>
  void once(F&& f) {
    items(1, 1, [&](int64_t) { f(); });
  }

 private:
  void wait_for(PhaseCounter& c, int64_t n) {
    // Spin a little (the other items are usually moments from done), then give the core away between
    // looks: the thread we wait for may be waiting for this very core.
    for (int spins = 0; c.done.load(std::memory_order_acquire) < n; ++spins) {
      if (spins < 2000)
        STRATA_PAUSE();
      else
        std::this_thread::yield();
    }
  }

  PhaseCounters& counters_;
  size_t phase_ = 0;
};

}  // namespace
