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
#include <vector>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#include <thread>
#endif

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
  std::atomic<int32_t> sleepers{0};         // threads asleep until the phase ends
  std::atomic<uint32_t> wakes{0};           // bumped when the phase ends with sleepers (their futex word)
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
      finish(c, last - first, n);
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
      finish(c, last - first, n);
      first = following;
    }
    wait_for(c, n);
  }

  template <typename F>
  void once(F&& f) {
    items(1, 1, [&](int64_t) { f(); });
  }

 private:
  // Spin a little (the other items are usually moments from done), then sleep until the phase ends.
  // Sleeping, not yielding: the thread we wait for may have lost its core to another process, and
  // only a core left idle lets the OS move it over (a thread that yields still holds its core).
  static constexpr int kSpins = 4000;  // PAUSEs, ~40 us on the Xeon this was measured on

  void wait_for(PhaseCounter& c, int64_t n) {
    for (int spins = 0; spins < kSpins; ++spins) {
      if (c.done.load(std::memory_order_acquire) >= n) return;
      STRATA_PAUSE();
    }
    c.sleepers.fetch_add(1, std::memory_order_seq_cst);
    for (;;) {
      const uint32_t seen = c.wakes.load(std::memory_order_seq_cst);  // before the check, see finish()
      if (c.done.load(std::memory_order_seq_cst) >= n) break;
      sleep_while_unchanged(c.wakes, seen);
    }
    c.sleepers.fetch_sub(1, std::memory_order_relaxed);
  }

  // Marks `count` items done; the thread that finishes the phase wakes its sleepers. A sleeper adds
  // itself before it checks `done` and this reads `sleepers` after adding to it (both sequentially
  // consistent), so either the sleeper sees the phase over or this sees the sleeper, whose futex word
  // then changes before (or while) it sleeps.
  static void finish(PhaseCounter& c, int64_t count, int64_t n) {
    const int64_t before = c.done.fetch_add(count, std::memory_order_seq_cst);
    if (before + count >= n && c.sleepers.load(std::memory_order_seq_cst) > 0) {
      c.wakes.fetch_add(1, std::memory_order_seq_cst);
      wake_all(c.wakes);
    }
  }

#if defined(__linux__)
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t) && std::atomic<uint32_t>::is_always_lock_free,
                "a futex word must be a plain 32-bit integer");
  static void sleep_while_unchanged(std::atomic<uint32_t>& word, uint32_t seen) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0);
  }
  static void wake_all(std::atomic<uint32_t>& word) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
  }
#else
  static void sleep_while_unchanged(std::atomic<uint32_t>& word, uint32_t seen) {
    if (word.load(std::memory_order_seq_cst) == seen) std::this_thread::yield();
  }
  static void wake_all(std::atomic<uint32_t>&) {}
#endif

  PhaseCounters& counters_;
  size_t phase_ = 0;
};

}  // namespace
