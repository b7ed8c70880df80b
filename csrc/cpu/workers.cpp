// Threads of fastbert's own for a busy machine (pool.h's run_on_workers): a region never waits for a thread that has
// not started. The caller publishes the region and claims jobs at once; a worker joins only while jobs are left, and
// the region's end waits only for workers that joined (each finishing the job it holds). A worker the OS has not run
// costs the region nothing but its share of the work, where an OpenMP team's barrier waits a time slice for it.
//
// One word orders it all: state = epoch << 32 | closed << 31 | joined. A worker joins region `epoch` by a
// compare-and-swap that fails once the caller closed it or moved on, so the region's fields it read before are that
// region's. Idle workers spin briefly, then sleep on a futex the caller wakes only when someone sleeps.
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <thread>

#include "pool.h"

namespace fastbert::cpu {
namespace {

constexpr uint64_t kClosed = uint64_t(1) << 31, kJoinedMask = kClosed - 1;
// A worker spins this long for the next region before sleeping: a forward's regions follow each other within
// microseconds, a sleeping thread takes tens of microseconds to wake, and a spinning one takes a busy CPU's share.
constexpr int64_t kSpinNs = 30'000;
constexpr int kMaxWorkers = 255;

// A spin-wait's pause: it lets the core's other hardware thread run and saves power while this one waits.
inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

class Workers {
 public:
  // Runs the region on the caller and up to threads - 1 workers; false (nothing run) while another caller holds them.
  bool run(int64_t jobs, int threads, JobFn fn, void* body) {
    if (taken_.exchange(true, std::memory_order_acquire)) return false;
    grow(std::min(threads - 1, kMaxWorkers));
    fn_.store(fn, std::memory_order_relaxed);
    body_.store(body, std::memory_order_relaxed);
    jobs_.store(jobs, std::memory_order_relaxed);
    threads_.store(threads, std::memory_order_relaxed);
    next_.store(0, std::memory_order_relaxed);
    const uint64_t epoch = (state_.load(std::memory_order_relaxed) >> 32) + 1;
    state_.store(epoch << 32, std::memory_order_seq_cst);  // open, nobody joined
    wake_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex(FUTEX_WAKE_PRIVATE, INT32_MAX);
    for (int64_t job; (job = next_.fetch_add(1, std::memory_order_relaxed)) < jobs;) fn(body, job, 0);
    state_.fetch_or(kClosed, std::memory_order_acq_rel);  // no worker joins from here on
    // Workers that joined hold at most a job each; one the OS preempted mid-job gets this CPU by the yield.
    for (int spins = 0; (state_.load(std::memory_order_acquire) & kJoinedMask) != 0; ++spins) {
      if (spins < 2000) relax(); else sched_yield();
    }
    taken_.store(false, std::memory_order_release);
    return true;
  }

  int count() const { return started_.load(std::memory_order_relaxed); }

 private:
  void grow(int wanted) {
    if (started_.load(std::memory_order_acquire) >= wanted) return;
    std::lock_guard<std::mutex> lock(grow_);
    for (int slot = started_.load() + 1; slot <= wanted; ++slot) {
      std::thread([this, slot] { work(slot); }).detach();
      started_.store(slot, std::memory_order_release);
    }
  }

  [[noreturn]] void work(int slot) {
    uint64_t seen = state_.load(std::memory_order_acquire) >> 32;
    for (;;) {
      uint64_t s = wait_past(seen);
      seen = s >> 32;
      if ((s & kClosed) || slot >= threads_.load(std::memory_order_relaxed)) continue;
      const JobFn fn = fn_.load(std::memory_order_relaxed);
      void* const body = body_.load(std::memory_order_relaxed);
      const int64_t jobs = jobs_.load(std::memory_order_relaxed);
      bool joined = false;
      while (!(s & kClosed) && (s >> 32) == seen && !joined)
        joined = state_.compare_exchange_weak(s, s + 1, std::memory_order_acquire, std::memory_order_acquire);
      if (!joined) continue;
      for (int64_t job; (job = next_.fetch_add(1, std::memory_order_relaxed)) < jobs;) fn(body, job, slot);
      state_.fetch_sub(1, std::memory_order_release);
    }
  }

  // The state of the first region after epoch `seen`: spun for kSpinNs, then slept for.
  uint64_t wait_past(uint64_t seen) {
    const int64_t until = now_ns() + kSpinNs;
    for (int i = 0;; ++i) {
      const uint64_t s = state_.load(std::memory_order_acquire);
      if ((s >> 32) != seen) return s;
      if ((i & 63) == 63 && now_ns() > until) break;
      relax();
    }
    for (;;) {
      const uint32_t word = wake_.load(std::memory_order_seq_cst);
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      const uint64_t s = state_.load(std::memory_order_seq_cst);
      if ((s >> 32) == seen) futex(FUTEX_WAIT_PRIVATE, word);  // returns at once if a region came since `word`
      sleepers_.fetch_sub(1, std::memory_order_relaxed);
      if ((s >> 32) != seen) return s;
      const uint64_t after = state_.load(std::memory_order_acquire);
      if ((after >> 32) != seen) return after;
    }
  }

  // FUTEX_WAIT: sleep while the word still reads `value`; FUTEX_WAKE: wake up to `value` sleepers.
  void futex(int op, uint32_t value) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&wake_), op, value, nullptr, nullptr, 0);
  }

  std::atomic<uint64_t> state_{0};
  std::atomic<uint32_t> wake_{0};  // the futex word: one more per region
  std::atomic<int> sleepers_{0};
  std::atomic<JobFn> fn_{nullptr};
  std::atomic<void*> body_{nullptr};
  std::atomic<int64_t> jobs_{0}, next_{0};
  std::atomic<int> threads_{0}, started_{0};
  std::atomic<bool> taken_{false};
  std::mutex grow_;
};

static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t) && std::atomic<uint32_t>::is_always_lock_free);

// Never destroyed: its detached threads sleep in it until the process exits.
Workers& workers() {
  static Workers* const w = new Workers;
  return *w;
}

}  // namespace

bool run_on_workers(int64_t jobs, int threads, JobFn fn, void* body) { return workers().run(jobs, threads, fn, body); }

int worker_count() { return workers().count(); }

}  // namespace fastbert::cpu
