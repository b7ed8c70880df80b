// The kernels' parallel regions (pool.h): OpenMP teams (torch's, so no second set of threads competes with them),
// jobs claimed from one counter, and the busy-host policy while the machine is oversubscribed.
#include "pool.h"

#include <omp.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <string>

namespace fastbert::cpu {
namespace {

// A team thread that starts a region this late was not run by the OS (a woken idle thread starts in tens of
// microseconds): the CPUs are shared with other work.
constexpr int64_t kLateNs = 500'000;
// While busy, one region every probe span runs on the team again to see whether it still comes late: the span doubles
// while probes do, and kPromptToLeave prompt probes in a row end the busy spell (a team thread that was spinning after
// the previous region starts promptly on a loaded machine too).
constexpr int64_t kProbeFirstNs = 50'000'000, kProbeMaxNs = 800'000'000;
constexpr int kPromptToLeave = 3;
// A probe is the team's regions for kProbeNs and at least kProbeRegions of them, not one region: a team thread woken
// from sleep preempts a busy neighbour at once (the scheduler favours a thread that slept), so the first region
// after a pause is prompt on a busy machine too; the next ones wait for the neighbour's time slice.
constexpr int64_t kProbeNs = 10'000'000;
constexpr int kProbeRegions = 8;

std::atomic<bool> busy{false};                   // regions follow the busy-host policy, probes aside
std::atomic<int64_t> next_probe{0};              // while busy: steady-clock ns from which a region probes the team
std::atomic<int64_t> probe_span{kProbeFirstNs};  // from one probe to the next
std::atomic<int> prompt_probes{0};               // in a row
std::atomic<int64_t> probe_end{0};               // while a probe runs: when it may end (0: none running)
std::atomic<int> probe_regions{0};               // prompt regions of the probe running
std::atomic<int64_t> late_regions{0}, busy_spells{0};
// The last 32 team regions, newest in bit 0, 1 where late. One late region alone is no sign of a busy machine: a VM's
// idle vCPU or a team's first start can take that long; kLateOfRecent of the last 32 are.
std::atomic<uint32_t> history{0};
constexpr int kLateOfRecent = 3;

std::atomic<BusyPolicy> policy{BusyPolicy::pool};
thread_local int solo_depth = 0;  // SoloScopes open on this thread
constexpr const char* kPolicyNames[] = {"pool", "solo", "off"};  // BusyPolicy's order

// A child forked after the parent's team ran has none of its threads, and GNU OpenMP hangs the child's first region
// (a DataLoader worker, a multiprocessing pool): its regions run on the calling thread.
std::atomic<bool> forked{false};
const int fork_handler = pthread_atfork(nullptr, nullptr, [] { forked.store(true); });

}  // namespace

BusyPolicy busy_policy() { return policy.load(std::memory_order_relaxed); }

const char* busy_policy_name() { return kPolicyNames[int(busy_policy())]; }

bool set_busy_policy(const std::string& name) {
  for (int i = 0; i < 3; ++i) {
    if (name != kPolicyNames[i]) continue;
    policy.store(BusyPolicy(i), std::memory_order_relaxed);
    busy.store(false);  // a spell begun under the old policy ends
    return true;
  }
  return false;
}

void judge_region(int64_t latest_start_ns) {
  const bool late = latest_start_ns >= kLateNs;
  const uint32_t recent = history.load(std::memory_order_relaxed) << 1 | uint32_t(late);
  history.store(recent, std::memory_order_relaxed);
  if (late) late_regions.fetch_add(1, std::memory_order_relaxed);  // counted with the policy off too, for explain()
  if (busy_policy() == BusyPolicy::off) return;
  const auto probe_in = [](int64_t span) {
    probe_span.store(span, std::memory_order_relaxed);
    next_probe.store(now_ns() + span, std::memory_order_relaxed);
  };
  if (!busy.load(std::memory_order_relaxed)) {
    if (!late || __builtin_popcount(recent) < kLateOfRecent) return;
    busy_spells.fetch_add(1, std::memory_order_relaxed);
    prompt_probes.store(0, std::memory_order_relaxed);
    probe_end.store(0, std::memory_order_relaxed);
    probe_in(kProbeFirstNs);
    busy.store(true, std::memory_order_relaxed);
  } else if (late) {  // a probe that found the team late: the next one later
    prompt_probes.store(0, std::memory_order_relaxed);
    probe_end.store(0, std::memory_order_relaxed);
    probe_in(std::min(2 * probe_span.load(std::memory_order_relaxed), kProbeMaxNs));
  } else if (const int64_t now = now_ns(), end = probe_end.load(std::memory_order_relaxed); end == 0) {
    probe_end.store(now + kProbeNs, std::memory_order_relaxed);  // a probe's first region
    probe_regions.store(1, std::memory_order_relaxed);
  } else if (probe_regions.fetch_add(1, std::memory_order_relaxed) + 1 >= kProbeRegions && now >= end) {
    probe_end.store(0, std::memory_order_relaxed);  // a prompt probe
    if (prompt_probes.fetch_add(1, std::memory_order_relaxed) + 1 >= kPromptToLeave)
      busy.store(false, std::memory_order_relaxed);
    else
      probe_in(kProbeFirstNs);
  }
}

bool oversubscribed() { return busy_policy() != BusyPolicy::off && busy.load(std::memory_order_relaxed); }

int64_t probe_in_ns() {
  return oversubscribed() ? std::max<int64_t>(0, next_probe.load(std::memory_order_relaxed) - now_ns()) : 0;
}

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
  if (threads > 1 && (solo_depth > 0 || omp_in_parallel() || forked.load(std::memory_order_relaxed))) threads = 1;
  if (threads > 1 && busy.load(std::memory_order_relaxed) && now_ns() < next_probe.load(std::memory_order_relaxed)) {
    if (busy_policy() == BusyPolicy::pool && run_on_workers(jobs, threads, fn, body)) return;
    threads = 1;  // solo, or another calling thread holds the workers
  }
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

namespace {

thread_local int aside_depth = 0;    // team_enter() calls on this thread not yet left
thread_local int aside_threads = 0;  // the team size team_enter() narrowed from (0: not narrowed)

}  // namespace

void team_enter(bool outermost) {
  if (outermost && aside_depth > 0) {  // an earlier scope never left: close it
    aside_depth = 1;
    team_leave();
  }
  if (aside_depth++ > 0 || !oversubscribed()) return;
  const int threads = omp_get_max_threads();
  if (threads <= 1) return;
  aside_threads = threads;
  omp_set_num_threads(threads - 1);
}

void team_leave() {
  if (aside_depth == 0 || --aside_depth > 0 || aside_threads == 0) return;
  omp_set_num_threads(aside_threads);
  aside_threads = 0;
}

bool team_narrowed() { return aside_threads > 0; }

int usable_threads(int torch_threads, std::string* why) {
  static const int affinity = affinity_cpus(), quota = cgroup_cpus();
  if (solo_depth > 0) {
    if (why != nullptr) *why = "a job of a coarser region (SoloScope)";
    return 1;
  }
  int n = std::max(aside_threads > 0 ? aside_threads : torch_threads, 1);
  const char* reason = "torch's intra-op threads";
  if (affinity > 0 && affinity < n) n = affinity, reason = "this process's CPU affinity";
  if (quota > 0 && quota < n) n = quota, reason = "the cgroup's CPU quota";
  if (why != nullptr) *why = reason;
  return n;
}

namespace {
thread_local int solo_omp_threads = 0;  // this thread's OpenMP team size before its outermost SoloScope
}  // namespace

SoloScope::SoloScope() {
  if (solo_depth++ > 0) return;
  solo_omp_threads = omp_get_max_threads();
  omp_set_num_threads(1);
}

SoloScope::~SoloScope() {
  if (--solo_depth == 0) omp_set_num_threads(solo_omp_threads);
}

int64_t late_region_count() { return late_regions.load(std::memory_order_relaxed); }

int64_t busy_spell_count() { return busy_spells.load(std::memory_order_relaxed); }

}  // namespace fastbert::cpu
