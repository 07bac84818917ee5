// Times the idle spin of GNU libgomp (torch's OpenMP runtime): a waiting thread loads a flag and
// relaxes (PAUSE on x86) GOMP_SPINCOUNT times before it sleeps. threads.py turns the time one spin
// takes on this CPU into the count that spins for a given time.

#include <atomic>
#include <chrono>
#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
static inline void relax() { _mm_pause(); }  // libgomp's cpu_relax on x86: "rep; nop"
#else
static inline void relax() { asm volatile("" ::: "memory"); }
#endif

static std::atomic<int> never_set{0};

extern "C" {

// Seconds `spins` iterations of libgomp's wait loop take (the flag never changes).
double strata_spin_seconds(int64_t spins) {
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < spins; ++i) {
    if (never_set.load(std::memory_order_relaxed) != 0) break;
    relax();
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // extern "C"
