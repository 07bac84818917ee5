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
// holds nobody up, and when it runs again it finds the phases it missed done and catches up. Every
// thread runs the same sequence of phases; each phase has its own pair of counters, in an array the
// region shares.
//
// A run of items a thread holds when the OS takes it away is still waited for, for as long as the
// other process keeps its core (milliseconds), and Linux does not move the preempted thread over to
// the core left idle while it counts as cache-hot. Where every item of a region may run twice (it
// reads only what earlier phases wrote, and writes only final values), the region asks for stealing
// (PhaseCounters' `threads`): each thread publishes the run it holds and its progress through it
// before each item, and a thread that has run out of items in a phase takes over a run whose progress
// has not moved for kQuietSeconds, from the item its holder was on. The thread taken away finishes
// that one item when it runs again, finds its run gone, and catches up.
//
// That late item writes the same values, but maybe into buffers a later phase reuses: a region that
// steals counts its phases in epochs (begin_epoch), whose buffers differ from the epoch before's, and
// a thread entering epoch e waits until every run stolen in epoch e - 2 has been given up by the
// thread it was taken from. A late item may also read buffers of the epoch before, which epoch e + 1
// rewrites: what it then writes must be read by nobody after its own epoch (decode_forward.cpp).
//
// On 2 cores through `strata up` (bfloat16, 64 streams, the gateway and clients on the same cores),
// stealing took the cores' idle share from 7.0-7.8% to 5.7-6.5% (three interleaved rounds each).

#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <ctime>
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

// The run of items a thread holds, for others to take over (stealing regions only). One 64-bit word:
// the phase (+1, so that 0 is "none"), the run's first item and count, how many of them its holder
// has finished, how many times it was taken over, and its state.
struct alignas(64) HeldRun {
  std::atomic<uint64_t> word{0};
};

namespace run_word {
constexpr uint64_t kRunning = 1, kStolen = 2;
constexpr int kStateBits = 2, kStealsBits = 2, kDoneBits = 10, kCountBits = 10, kFirstBits = 24, kPhaseBits = 16;
constexpr int kDoneShift = kStateBits + kStealsBits, kCountShift = kDoneShift + kDoneBits,
              kFirstShift = kCountShift + kCountBits, kPhaseShift = kFirstShift + kFirstBits;
static_assert(kPhaseShift + kPhaseBits == 64, "the fields fill one word");
constexpr uint64_t field(uint64_t w, int shift, int bits) { return (w >> shift) & ((uint64_t(1) << bits) - 1); }
inline bool fits(size_t phase, int64_t first, int64_t count) {
  return phase + 1 < (uint64_t(1) << kPhaseBits) && first < (int64_t(1) << kFirstBits) &&
         count < (int64_t(1) << kCountBits);
}
inline uint64_t make(size_t phase, int64_t first, int64_t count, int64_t done = 0, uint64_t steals = 0) {
  return (uint64_t(phase + 1) << kPhaseShift) | (uint64_t(first) << kFirstShift) | (uint64_t(count) << kCountShift) |
         (uint64_t(done) << kDoneShift) | (steals << kStateBits) | kRunning;
}
inline size_t phase(uint64_t w) { return size_t(w >> kPhaseShift) - 1; }
inline int64_t first(uint64_t w) { return int64_t(field(w, kFirstShift, kFirstBits)); }
inline int64_t count(uint64_t w) { return int64_t(field(w, kCountShift, kCountBits)); }
inline int64_t done(uint64_t w) { return int64_t(field(w, kDoneShift, kDoneBits)); }
inline uint64_t steals(uint64_t w) { return field(w, kStateBits, kStealsBits); }
inline uint64_t state(uint64_t w) { return w & 3; }
inline uint64_t with_done(uint64_t w, int64_t done) {
  return (w & ~(((uint64_t(1) << kDoneBits) - 1) << kDoneShift)) | (uint64_t(done) << kDoneShift);
}
constexpr uint64_t kMaxSteals = (uint64_t(1) << kStealsBits) - 1;  // a run taken over this often stays put
}  // namespace run_word

// Phase counters for one run of a parallel region (zeroed: create one per run). With `threads` > 0
// the region's threads (that many, numbered by omp_get_thread_num) steal each other's runs, over
// `epochs` epochs (see above).
class PhaseCounters {
 public:
  explicit PhaseCounters(size_t phases, int threads = 0, size_t epochs = 0)
      : counters_(phases), held_(threads > 0 ? 2 * threads : 0), unreleased_(threads > 0 ? epochs : 0) {}
  PhaseCounter& at(size_t phase) {
    if (phase >= counters_.size()) {  // a caller sized it for fewer phases than it runs: a bug
      std::fprintf(stderr, "strata: PhaseCounters sized for %zu phases, phase %zu asked\n", counters_.size(), phase);
      std::abort();
    }
    return counters_[phase];
  }
  bool steals() const { return !held_.empty(); }
  int threads() const { return int(held_.size() / 2); }
  // Thread t's two runs (its current one and, in items_ahead, the one it claimed next).
  HeldRun& held(int thread, int which) { return held_[2 * thread + which]; }
  // Runs stolen in an epoch that their first owners have not given up yet.
  std::atomic<int32_t>& unreleased(size_t epoch) {
    if (epoch >= unreleased_.size()) {
      std::fprintf(stderr, "strata: PhaseCounters sized for %zu epochs, epoch %zu asked\n", unreleased_.size(), epoch);
      std::abort();
    }
    return unreleased_[epoch];
  }
  std::atomic<uint32_t>& releases() { return releases_; }  // bumped when an epoch's count reaches 0 (a futex word)
  std::atomic<int64_t>& stolen_runs() { return stolen_runs_; }

 private:
  std::vector<PhaseCounter> counters_;
  std::vector<HeldRun> held_;
  std::vector<std::atomic<int32_t>> unreleased_;
  alignas(64) std::atomic<uint32_t> releases_{0};
  std::atomic<int64_t> stolen_runs_{0};
};

// One per thread, inside the region, over the region's shared PhaseCounters; `thread` is the caller's
// omp_get_thread_num() (used where the counters steal).
class ProgressSplit {
 public:
  explicit ProgressSplit(PhaseCounters& counters, int thread = 0)
      : counters_(counters), thread_(counters.steals() ? thread : -1),
        watches_(counters.steals() ? 2 * counters.threads() : 0) {}

  template <typename F>
  void items(int64_t n, int64_t grab, F&& f) {
    const size_t phase = phase_++;
    PhaseCounter& c = counters_.at(phase);
    auto run = [&](int64_t i, int64_t) { f(i); };
    for (;;) {
      const int64_t first = c.next.fetch_add(grab, std::memory_order_relaxed);
      if (first >= n) break;
      const int64_t last = std::min(n, first + grab);
      run_held(c, n, hold(0, phase, first, last - first), first, first, last, run);
    }
    wait_for(c, phase, n, run);
  }

  // As items, with f(i, next): `next` the item this thread runs after i, or -1 when none. The next run
  // of items is claimed before the last item of the current one runs, so that f can prefetch for it.
  template <typename F>
  void items_ahead(int64_t n, int64_t grab, F&& f) {
    const size_t phase = phase_++;
    PhaseCounter& c = counters_.at(phase);
    int which = 0;
    int64_t first = c.next.fetch_add(grab, std::memory_order_relaxed);
    Held held = first < n ? hold(which, phase, first, std::min(n, first + grab) - first) : Held{};
    while (first < n) {
      const int64_t last = std::min(n, first + grab);
      const int64_t following = c.next.fetch_add(grab, std::memory_order_relaxed);
      const Held held_next =
          following < n ? hold(1 - which, phase, following, std::min(n, following + grab) - following) : Held{};
      const int64_t after_last = following < n ? following : -1;
      run_held(c, n, held, first, first, last, [&](int64_t i, int64_t) { f(i, i + 1 < last ? i + 1 : after_last); });
      first = following;
      held = held_next;
      which = 1 - which;
    }
    wait_for(c, phase, n, [&](int64_t i, int64_t last) { f(i, i + 1 < last ? i + 1 : -1); });
  }

  template <typename F>
  void once(F&& f) {
    items(1, 1, [&](int64_t) { f(); });
  }

  // Stealing regions: the phases from here on belong to `epoch`; waits until every run stolen in epoch
  // - 2 has been given up by its first owner (its buffers are this epoch's).
  void begin_epoch(size_t epoch) {
    epoch_ = epoch;
    if (thread_ < 0 || epoch < 2) return;
    std::atomic<int32_t>& unreleased = counters_.unreleased(epoch - 2);
    for (int spins = 0; spins < kSpins; ++spins) {
      if (unreleased.load(std::memory_order_acquire) == 0) return;
      STRATA_PAUSE();
    }
    for (;;) {
      const uint32_t seen = counters_.releases().load(std::memory_order_seq_cst);
      if (unreleased.load(std::memory_order_seq_cst) == 0) return;
      sleep_while_unchanged(counters_.releases(), seen, kLookEveryNs);
    }
  }

 private:
  // Spin a little (the other items are usually moments from done), then sleep until the phase ends.
  // Sleeping, not yielding: the thread we wait for may have lost its core to another process, and
  // only a core left idle lets the OS move it over (a thread that yields still holds its core).
  static constexpr int kSpins = 4000;  // PAUSEs, ~40 us on the Xeon this was measured on
  // Stealing: a run whose holder made no progress for this long is taken over (its holder has most
  // likely lost its core: a work item takes microseconds to tens of them).
  static constexpr double kQuietSeconds = 100e-6;
  static constexpr int kSpinsPerLook = 16;   // how often a spinning thread looks at the others' runs
  static constexpr long kLookEveryNs = 50000;  // and a sleeping one

  // A run this thread published (`at` null where it did not), and the word it published.
  struct Held {
    HeldRun* at = nullptr;
    uint64_t word = 0;
  };

  // Publishes this thread's run [first, first + count) of `phase`, `done` of its items finished and
  // taken over `steals` times, for others to take over (stealing regions only, runs that fit a word).
  Held hold(int which, size_t phase, int64_t first, int64_t count, int64_t done = 0, uint64_t steals = 0) {
    if (thread_ < 0 || !run_word::fits(phase, first, count)) return {};
    HeldRun& at = counters_.held(thread_, which);
    const uint64_t word = run_word::make(phase, first, count, done, steals);
    at.word.store(word, std::memory_order_release);
    return {&at, word};
  }

  // Runs the items of a run this thread holds, from item `from`, f(i, last), publishing its progress
  // before each item; stops where another thread took the run over. The thread that holds the run
  // when it ends counts all its items done (those finished before a takeover included); a thread whose
  // run was taken gives it up (release).
  template <typename F>
  void run_held(PhaseCounter& c, int64_t n, Held held, int64_t first, int64_t from, int64_t last, F&& f) {
    if (held.at == nullptr) {
      for (int64_t i = from; i < last; ++i) f(i, last);
      finish(c, last - first, n);
      return;
    }
    uint64_t mine = held.word;
    bool taken = held.at->word.load(std::memory_order_relaxed) != mine;
    for (int64_t i = from; i < last && !taken; ++i) {
      if (i > from) {
        const uint64_t progressed = run_word::with_done(mine, i - first);
        taken = !held.at->word.compare_exchange_strong(mine, progressed, std::memory_order_acq_rel);
        if (taken) break;
        mine = progressed;
      }
      f(i, last);
    }
    if (!taken && held.at->word.compare_exchange_strong(mine, 0, std::memory_order_acq_rel)) {
      finish(c, last - first, n);
    } else {
      held.at->word.store(0, std::memory_order_relaxed);
      release();
    }
  }

  // This thread gave up a run another took over: the epoch's count of such runs goes down.
  void release() {
    if (counters_.unreleased(epoch_).fetch_sub(1, std::memory_order_seq_cst) == 1) {
      counters_.releases().fetch_add(1, std::memory_order_seq_cst);
      wake_all(counters_.releases());
    }
  }

  // Looks at the runs of `phase` other threads hold: one whose word (its progress included) stayed
  // the same for kQuietSeconds (twice that after each takeover) is taken over, run from the item its
  // holder was on, and true returned; false when there was none.
  template <typename F>
  bool steal_stalled(PhaseCounter& c, size_t phase, int64_t n, F&& f) {
    const double now = seconds_now();
    for (int t = 0; t < counters_.threads(); ++t) {
      if (t == thread_) continue;
      for (int which = 0; which < 2; ++which) {
        std::atomic<uint64_t>& word = counters_.held(t, which).word;
        Watch& watch = watches_[2 * t + which];
        uint64_t seen = word.load(std::memory_order_acquire);
        if (seen == 0 || run_word::state(seen) != run_word::kRunning || run_word::phase(seen) != phase ||
            run_word::steals(seen) >= run_word::kMaxSteals)
          continue;
        if (seen != watch.word) {
          watch = {seen, now};
          continue;
        }
        if (now - watch.since < kQuietSeconds * double(1 << run_word::steals(seen))) continue;
        counters_.unreleased(epoch_).fetch_add(1, std::memory_order_seq_cst);  // before its holder can see it
        if (!word.compare_exchange_strong(seen, seen ^ run_word::kRunning ^ run_word::kStolen,
                                          std::memory_order_acq_rel)) {
          release();  // undoes the count: the holder moved on meanwhile
          continue;
        }
        counters_.stolen_runs().fetch_add(1, std::memory_order_relaxed);
        const int64_t first = run_word::first(seen), count = run_word::count(seen), done = run_word::done(seen);
        run_held(c, n, hold(0, phase, first, count, done, run_word::steals(seen) + 1), first, first + done,
                 first + count, f);
        return true;
      }
    }
    return false;
  }

  // Until the phase's last item is done: spins (looking for stalled runs to take over where the region
  // steals), then sleeps (waking now and then to look again where it steals).
  template <typename F>
  void wait_for(PhaseCounter& c, size_t phase, int64_t n, F&& f) {
    for (int spins = 0; spins < kSpins; ++spins) {
      if (c.done.load(std::memory_order_acquire) >= n) return;
      if (thread_ >= 0 && spins % kSpinsPerLook == 0 && steal_stalled(c, phase, n, f)) continue;
      STRATA_PAUSE();
    }
    c.sleepers.fetch_add(1, std::memory_order_seq_cst);
    for (;;) {
      const uint32_t seen = c.wakes.load(std::memory_order_seq_cst);  // before the check, see finish()
      if (c.done.load(std::memory_order_seq_cst) >= n) break;
      if (thread_ >= 0 && steal_stalled(c, phase, n, f)) continue;
      sleep_while_unchanged(c.wakes, seen, thread_ >= 0 ? kLookEveryNs : 0);
    }
    c.sleepers.fetch_sub(1, std::memory_order_relaxed);
  }

  static double seconds_now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
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
  // Sleeps while `word` holds `seen`, at most `timeout_ns` (0: no limit).
  static void sleep_while_unchanged(std::atomic<uint32_t>& word, uint32_t seen, long timeout_ns) {
    struct timespec timeout {0, timeout_ns};
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, seen, timeout_ns ? &timeout : nullptr,
            nullptr, 0);
  }
  static void wake_all(std::atomic<uint32_t>& word) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
  }
#else
  static void sleep_while_unchanged(std::atomic<uint32_t>& word, uint32_t seen, long) {
    if (word.load(std::memory_order_seq_cst) == seen) std::this_thread::yield();
  }
  static void wake_all(std::atomic<uint32_t>&) {}
#endif

  // A word another thread published, and since when this thread has seen it unchanged.
  struct Watch {
    uint64_t word = 0;
    double since = 0.0;
  };

  PhaseCounters& counters_;
  const int thread_;  // -1: no stealing
  size_t phase_ = 0;
  size_t epoch_ = 0;
  std::vector<Watch> watches_;  // per held run of the region (stealing only)
};

}  // namespace
