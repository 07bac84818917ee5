// The threads of a step's parallel region bound to cores, one each: thread t of a team of n to the t-th
// of the cores the engine was given (threads.py's `binding_cores`), while the team has two threads or
// more and no more than those cores.
//
// Why: beside a process that keeps one of two cores busy, the OS scheduler left both threads of a
// two-thread team on the other core about as often as not (they sleep between steps, so the cores'
// loads look balanced to it), and the team got about one core: no faster than one thread. Bound one to
// each core, one thread has a core of its own and the other shares the busy one, and a thread that loses
// its core in the middle of a phase is taken over (work_split.h). The small shape's float32 batch-1
// decode step on 2 cores beside one busy process of the same session (in-process, --num-threads fixed,
// two alternating rounds): one thread 4.8-5.3 ms, two unbound 4.2-5.0, two bound 3.4-4.0; alone, two
// threads 2.5 ms either way. Through `strata up` (the launcher keeps the session, supervisor.py), output
// tok/s beside one busy process fell 1.80-2.13x at one stream before, 1.46-1.61x after (float32, four
// rounds each); at 64 streams 1.84-1.93x -> 1.56-1.61x (float32), 1.61-1.66x -> 1.40-1.51x (bfloat16);
// alone the same.
//
// The thread that enters the region (the one calling the step from Python) is bound only for the
// region and gets its own mask back at its end (`MasterBinding`): threads it starts later, and processes
// it spawns, inherit its mask (`strata bench overhead` starts the stack after its in-process engine
// ran). The team's other threads are OpenMP's, kept in its pool: they stay bound between steps, and
// torch's own parallel regions, which run on the same pool, find them where the step left them.

#pragma once

#include <cstdint>

#if defined(__linux__)
#include <sched.h>
#endif

namespace {

struct CoreList {
  const int32_t* cores;  // the cores in the order the team's threads take them; null: no binding
  int64_t count;
  bool binds(int team) const { return cores != nullptr && team >= 2 && team <= count; }
};

#if defined(__linux__)
inline bool set_own_affinity(const cpu_set_t& set) { return sched_setaffinity(0, sizeof(set), &set) == 0; }

// Binds one of the team's other threads to its core (once: it keeps it between steps, unless its place
// in the team changes).
inline void bind_team_thread(const CoreList& list, int thread, int team) {
  thread_local int32_t bound = -1;
  if (thread == 0 || !list.binds(team) || list.cores[thread] == bound) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(list.cores[thread], &set);
  if (set_own_affinity(set)) bound = list.cores[thread];
}

// The calling thread bound to the first core for as long as it lives, then given its mask back.
class MasterBinding {
 public:
  MasterBinding(const CoreList& list, int team) {
    if (!list.binds(team) || sched_getaffinity(0, sizeof(saved_), &saved_) != 0) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(list.cores[0], &set);
    bound_ = set_own_affinity(set);
  }
  ~MasterBinding() {
    if (bound_) set_own_affinity(saved_);
  }
  MasterBinding(const MasterBinding&) = delete;
  MasterBinding& operator=(const MasterBinding&) = delete;

 private:
  cpu_set_t saved_;
  bool bound_ = false;
};
#else  // elsewhere the threads go where the OS puts them
inline void bind_team_thread(const CoreList&, int, int) {}
class MasterBinding {
 public:
  MasterBinding(const CoreList&, int) {}
};
#endif

}  // namespace
