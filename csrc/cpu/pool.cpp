// The kernels' parallel regions (pool.h): OpenMP teams (torch's, so no second set of threads competes with them),
// jobs claimed from one counter, and a region that goes solo while the machine is oversubscribed.
#include "pool.h"

#include <omp.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <string>

namespace fastbert::cpu {
namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A team thread that starts a region this late was not run by the OS (a woken idle thread starts in tens of
// microseconds): the CPUs are shared with other work.
constexpr int64_t kLateNs = 500'000;
constexpr int64_t kSoloFirstNs = 50'000'000, kSoloMaxNs = 800'000'000;

std::atomic<int64_t> solo_until{0};         // steady-clock ns before which regions run on the calling thread
std::atomic<int64_t> solo_span{kSoloFirstNs};  // the next solo period: doubles while probes keep finding it busy
std::atomic<int64_t> late_regions{0};

// A child forked after the parent's team ran has none of its threads, and GNU OpenMP hangs the child's first region
// (a DataLoader worker, a multiprocessing pool): its regions run on the calling thread.
std::atomic<bool> forked{false};
const int fork_handler = pthread_atfork(nullptr, nullptr, [] { forked.store(true); });

}  // namespace

bool solo_policy() {
  static const bool on = [] {
    const char* env = std::getenv("FASTBERT_BUSY_SOLO");
    return env != nullptr && std::string(env) == "1";
  }();
  return on;
}

void judge_region(int64_t latest_start_ns) {
  if (latest_start_ns < kLateNs) {  // prompt: end any backing off (stores only then: every region ends here)
    if (solo_span.load(std::memory_order_relaxed) != kSoloFirstNs) solo_span.store(kSoloFirstNs);
    if (solo_until.load(std::memory_order_relaxed) != 0) solo_until.store(0);
    return;
  }
  late_regions.fetch_add(1, std::memory_order_relaxed);  // counted with the policy off too (explain() says how many)
  if (!solo_policy()) return;
  const int64_t span = solo_span.load(std::memory_order_relaxed);
  solo_until.store(now_ns() + span, std::memory_order_relaxed);
  solo_span.store(std::min(2 * span, kSoloMaxNs), std::memory_order_relaxed);
}

int64_t solo_remaining_ns() { return std::max<int64_t>(0, solo_until.load(std::memory_order_relaxed) - now_ns()); }

namespace {

// ceil(quota / period) of cgroup v2's cpu.max or v1's cfs files; 0 where there is no quota.
int cgroup_cpus() {
  std::ifstream v2("/sys/fs/cgroup/cpu.max");
  std::string quota;
  double period = 0;
  if (v2 >> quota >> period)
    return quota == "max" || period <= 0 ? 0 : int(std::ceil(std::atof(quota.c_str()) / period));
  std::ifstream q("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), p("/sys/fs/cgroup/cpu/cpu.cfs_period_us");
  double quota_us = -1;
  if (q >> quota_us && p >> period && quota_us > 0 && period > 0) return int(std::ceil(quota_us / period));
  return 0;
}

int affinity_cpus() {
  cpu_set_t set;
  return sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 0;
}

}  // namespace

void run_jobs(int64_t jobs, int threads, JobFn fn, void* body) {
  threads = int(std::min<int64_t>(threads, jobs));
  if (threads > 1 && (omp_in_parallel() || forked.load(std::memory_order_relaxed) ||
                      now_ns() < solo_until.load(std::memory_order_relaxed)))
    threads = 1;
  if (threads <= 1) {
    for (int64_t job = 0; job < jobs; ++job) fn(body, job, 0);
    return;
  }
  std::atomic<int64_t> next{0}, latest_start{0};
  const int64_t start = now_ns();
#pragma omp parallel num_threads(threads)
  {
    const int slot = omp_get_thread_num();
    if (slot != 0) {
      const int64_t late = now_ns() - start;
      for (int64_t seen = latest_start.load(); late > seen && !latest_start.compare_exchange_weak(seen, late);) {
      }
    }
    for (int64_t job; (job = next.fetch_add(1, std::memory_order_relaxed)) < jobs;) fn(body, job, slot);
  }
  judge_region(latest_start.load());
}

int usable_threads(int torch_threads, std::string* why) {
  static const int affinity = affinity_cpus(), quota = cgroup_cpus();
  int n = std::max(torch_threads, 1);
  const char* reason = "torch's intra-op threads";
  if (affinity > 0 && affinity < n) n = affinity, reason = "this process's CPU affinity";
  if (quota > 0 && quota < n) n = quota, reason = "the cgroup's CPU quota";
  if (why != nullptr) *why = reason;
  return n;
}

int64_t late_region_count() { return late_regions.load(std::memory_order_relaxed); }

}  // namespace fastbert::cpu
