// The kernels' parallel regions: jobs claimed one at a time from a counter by the threads of an OpenMP team, and, while
// the machine is oversubscribed, by threads of fastbert's own that a region never waits for.
//
// An OpenMP region ends at a barrier every thread of its team must reach. On a shared machine a team thread the OS
// has not run yet holds the region for a time slice (milliseconds) while the caller waits, and a forward has a few
// hundred regions of tens of microseconds: 5-10x slower beside one busy neighbour. So each region notes how late its
// team threads started. One that started more than half a millisecond late (a woken idle thread starts in tens of
// microseconds), with two more of the last 32 late, begins a busy spell: regions follow the busy-host policy, except
// a probe on the team now and then (10 ms of its regions; 50 ms apart, doubling to 0.8 s while probes come late),
// until three probes in a row find the team prompt. The policy (FASTBERT_BUSY_HOST, or fastbert.backends.native.set_busy_host_policy):
//   pool (default): fastbert's own threads (workers.cpp), which the caller waits for only once they hold a job;
//   solo: the calling thread alone; off: the team throughout.
// Meanwhile fastbert's fp32/int8 GEMMs stay on its own kernels (a oneDNN GEMM waits on the team's barrier). The team
// is torch's own, so quiet, no second set of threads competes with the one oneDNN's GEMMs run on.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <type_traits>
#include <utility>

namespace fastbert::cpu {

using JobFn = void (*)(void* body, int64_t job, int slot);

// The steady clock in nanoseconds: what regions, busy spells and idle workers time themselves by.
inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Runs body(job, slot) for every job in [0, jobs) on up to `threads` threads, the caller one of them; `slot` in
// [0, threads) names the thread running the job (slot 0: the caller), for per-thread scratch.
void run_jobs(int64_t jobs, int threads, JobFn fn, void* body);

template <class F>
void parallel_jobs(int64_t jobs, int threads, F&& body) {
  using B = std::remove_reference_t<F>;
  run_jobs(jobs, threads, [](void* b, int64_t job, int slot) { (*static_cast<B*>(b))(job, slot); },
           const_cast<void*>(static_cast<const void*>(&body)));
}

// Rows [0, rows) in chunks of `chunk` rows: body(first, end, slot) per chunk.
template <class F>
void parallel_rows(int64_t rows, int64_t chunk, int threads, F&& body) {
  const int64_t jobs = (rows + chunk - 1) / chunk;
  parallel_jobs(jobs, threads, [&](int64_t job, int slot) {
    const int64_t first = job * chunk;
    body(first, first + chunk < rows ? first + chunk : rows, slot);
  });
}

// Chunks of a loop of n equal iterations: four per thread, so a thread that starts late leaves its share to others.
inline int64_t balanced_chunk(int64_t n, int threads) {
  const int64_t parts = 4 * int64_t(threads > 1 ? threads : 1);
  return n > parts ? (n + parts - 1) / parts : 1;
}

// Elements of T in whole cache lines covering n: a per-thread row of that stride never shares a line with the next.
template <class T>
constexpr int64_t line_stride(int64_t n) {
  constexpr int64_t per_line = 64 / int64_t(sizeof(T));
  return (n + per_line - 1) / per_line * per_line;
}

// Scratch aligned to a cache line and a whole number of lines long, zeroed unless asked not to be: two threads'
// buffers never share a line (a line both write moves between their cores on every write, slower than the work it
// holds), and a row of whole lines never straddles two (a tile load of 16 such rows reads 16 lines, not 32).
template <class T>
class LineBuffer {
 public:
  LineBuffer() = default;
  explicit LineBuffer(int64_t n, bool zeroed = true) { resize(n, zeroed); }
  void resize(int64_t n, bool zeroed = true) {  // to n elements (previous contents dropped)
    const size_t bytes = size_t(line_stride<T>(n > 0 ? n : 1)) * sizeof(T);
    data_.reset(static_cast<T*>(std::aligned_alloc(64, bytes)));
    if (!data_) throw std::bad_alloc();
    if (zeroed) std::memset(static_cast<void*>(data_.get()), 0, bytes);
  }
  bool empty() const { return !data_; }
  T* data() const { return data_.get(); }

 private:
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T, Free> data_;
};

// The threads the kernels may use: torch's intra-op count (the count before team_enter narrowed it, inside its scope),
// capped by this process's CPU affinity and by its cgroup's CPU quota (a container given 2 CPUs of a 64-core host), 1
// inside a SoloScope; `why` says which set it.
int usable_threads(int torch_threads, std::string* why = nullptr);

enum class BusyPolicy { pool, solo, off };

// The policy in force (pool until set; fastbert.backends.native sets FASTBERT_BUSY_HOST's at load) and its name.
BusyPolicy busy_policy();
const char* busy_policy_name();

// Sets the policy by name ("pool", "solo" or "off"); false, nothing changed, for any other name.
bool set_busy_policy(const std::string& name);

// Regions so far whose team came late, and busy spells begun.
int64_t late_region_count();
int64_t busy_spell_count();

// What ends every region on a team: `latest_start_ns` after its start, its last team thread began (the header's
// comment says what late and prompt regions do).
void judge_region(int64_t latest_start_ns);

// Whether a busy spell is on (never with the policy off), and nanoseconds until its next probe (0: none due).
bool oversubscribed();
int64_t probe_in_ns();

// The region on the caller and fastbert's own threads (workers.cpp); false, with nothing run, while another calling
// thread holds them.
bool run_on_workers(int64_t jobs, int threads, JobFn fn, void* body);

// A scope around a forward (fastbert.backends.native.team_scope): entered while a busy spell is on, torch's own ops
// and oneDNN's GEMMs on the calling thread run on one thread fewer to its end (on two CPUs, on the calling thread
// alone). A spell means a team thread keeps coming late, and a team region splits its work statically, so each waited
// a time slice for that thread; one thread fewer leaves the contended CPU to the neighbour. The kernels' regions keep
// the full count (usable_threads) and the busy-host policy. Nested scopes count; the outermost leave restores the
// team; `outermost` first closes a scope whose leave never came (a hook skipped by an interrupt). While narrowed,
// GEMMs are not timed (team_narrowed): a verdict would compare a narrowed team with the full one.
void team_enter(bool outermost = false);
void team_leave();
bool team_narrowed();

// Threads workers.cpp has started so far (0 until the first busy spell).
int worker_count();

// A scope in which the calling thread's regions run on it alone, usable_threads() is 1 and its OpenMP team is one
// thread (torch's ops and oneDNN's GEMMs inside run on it alone): the work inside is one job of a coarser region
// (encoder_layers' chunks of sequences) whose other jobs keep the other threads busy.
class SoloScope {
 public:
  SoloScope();
  ~SoloScope();
  SoloScope(const SoloScope&) = delete;
  SoloScope& operator=(const SoloScope&) = delete;
};

}  // namespace fastbert::cpu
