// The kernels' parallel regions: jobs claimed one at a time from a counter by the threads of an OpenMP team, and a
// region that runs on the calling thread alone while the machine is oversubscribed.
//
// An OpenMP region ends at a barrier every thread of its team must reach. On a shared machine a team thread the OS
// has not run yet holds the region for a time slice (milliseconds) while the caller waits, and a forward has a few
// hundred regions of tens of microseconds: 5-10x slower beside one busy neighbour, where one thread alone loses only
// the neighbour's share. So each region notes how late its team threads started; one that started more than half a
// millisecond late (a woken idle thread starts in tens of microseconds) sends the next 50 ms of regions to the calling
// thread alone, then a region tries the team again (the solo period doubles, to 0.8 s, while it keeps finding it
// late); fastbert's fp32 GEMMs also stay on its own kernel meanwhile (a oneDNN GEMM would wait on a team thread the
// same way). Opt-in (solo_policy): FASTBERT_BUSY_SOLO=1. The team is torch's own, so no second set of threads competes with the one
// oneDNN's GEMMs run on.
#pragma once

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

// Zeroed scratch aligned to a cache line and a whole number of lines long: two threads' buffers never share a line
// (a line both write moves between their cores on every write, slower than the work it holds).
template <class T>
class LineBuffer {
 public:
  LineBuffer() = default;
  explicit LineBuffer(int64_t n) { resize(n); }
  void resize(int64_t n) {  // to n zeroed elements (previous contents dropped)
    const size_t bytes = size_t(line_stride<T>(n > 0 ? n : 1)) * sizeof(T);
    data_.reset(static_cast<T*>(std::aligned_alloc(64, bytes)));
    if (!data_) throw std::bad_alloc();
    std::memset(static_cast<void*>(data_.get()), 0, bytes);
  }
  bool empty() const { return !data_; }
  T* data() const { return data_.get(); }

 private:
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T, Free> data_;
};

// The threads the kernels may use: torch's intra-op count, capped by this process's CPU affinity and by its cgroup's
// CPU quota (a container given 2 CPUs of a 64-core host); `why` says which of the three set it.
int usable_threads(int torch_threads, std::string* why = nullptr);

// Whether late regions start solo periods: only with FASTBERT_BUSY_SOLO=1 (read once). Off by default: another
// runtime's threads in the same process (OpenVINO's, after its own inference) make a team thread late on a quiet
// machine too, and the encode benchmark then ran fastbert fp32 at 452 sentences/s instead of 698.
bool solo_policy();

// Regions so far whose team came late (each started a solo period).
int64_t late_region_count();

// What ends every region on several threads: `latest_start_ns` after its start, its last team thread began. Late
// (over 0.5 ms) starts a solo period, or the next longer one; prompt ends them.
void judge_region(int64_t latest_start_ns);

// Nanoseconds left of the current solo period (0: regions use their threads).
int64_t solo_remaining_ns();

}  // namespace fastbert::cpu
