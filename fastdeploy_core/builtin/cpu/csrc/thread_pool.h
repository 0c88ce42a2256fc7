// The work-claiming thread pool every cpu kernel of this library shares (one set of workers).
//
// Threads split a job into chunks that the calling thread and the pool's workers claim from
// one atomic counter. The caller never waits for a worker that has not woken up: it only
// waits for chunks already claimed. (An OpenMP team waits at its barrier for every thread; on
// a busy 2-core machine one descheduled thread turned a 0.1 ms GEMV into 3-5 ms.)
//
// After a job a worker spins for FD_CPU_KERNEL_SPIN microseconds (default 200), yielding its
// core to any runnable thread on every turn, then sleeps on a condition variable. A decode
// step issues ~270 kernel calls a few microseconds apart: waking a sleeping worker for each
// (futex, scheduler) left the caller alone for most of a small GEMV, and a batch-1 step took
// ~25 ms instead of ~20 on a quiet machine. Spinning without yielding lost under load (a
// busy machine: 26 -> 32-37 ms): the spinner kept the core from the thread that had work.
// Sleeping after the window keeps an idle engine at 0% CPU.
//
// Size: FD_CPU_KERNEL_THREADS, else OMP_NUM_THREADS, else the hardware's thread count.
// Declared inline in a named namespace, so every source file of the library gets the same pool.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <sched.h>
#include <thread>
#include <vector>

namespace fd_kernels {

constexpr int kDefaultSpinMicros = 200;
// The index of a closing generation's claim word: past every job's chunk count (a job has
// fewer than 2^32 - 1 chunks), so nothing can be claimed from it.
constexpr uint64_t kNoChunk = 0xffffffffu;

class Pool {
 public:
  static Pool& instance() {
    static Pool pool;
    return pool;
  }

  // The calling thread and the workers.
  int64_t threads() const { return static_cast<int64_t>(workers_.size()) + 1; }

  // Calls fn(ctx, i) for i in [0, total), spread over the caller and the workers.
  void run(int64_t total, void (*fn)(void*, int64_t), void* ctx) {
    if (workers_.empty() || total <= 1 || total >= static_cast<int64_t>(kNoChunk)) {
      for (int64_t i = 0; i < total; ++i) fn(ctx, i);
      return;
    }
    std::lock_guard<std::mutex> serial(run_mutex_);  // one job at a time
    // Close the previous job before its fields change. A worker may still be in work() for it,
    // holding an exhausted claim word (gen, total); were next_ left as it is, that worker could
    // read the new total_, find its old index below it, win the claim (next_ still holds the
    // old word) and call a half-written fn_ / ctx_ -- or count a chunk into the new job's done_.
    // With the claim word moved to a closing generation whose index is past any total, every
    // claim of the old job fails, and a worker that reads the closing word leaves at once.
    const uint64_t closing = ++generation_;  // 32 bits, wrapping: the claim word holds 32
    next_.store((closing << 32) | kNoChunk, std::memory_order_seq_cst);
    fn_ = fn;
    ctx_ = ctx;
    total_ = total;
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = ++generation_;
    next_.store(gen << 32, std::memory_order_release);  // publishes fn_, ctx_, total_
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      cv_.notify_all();
    }
    work(gen);
    while (done_.load(std::memory_order_acquire) < total) _mm_pause();
  }

 private:
  Pool() {
    int threads = static_cast<int>(std::thread::hardware_concurrency());
    if (const char* env = std::getenv("OMP_NUM_THREADS")) threads = std::atoi(env);
    if (const char* env = std::getenv("FD_CPU_KERNEL_THREADS")) threads = std::atoi(env);
    threads = std::max(1, std::min(threads, 64));
    if (const char* env = std::getenv("FD_CPU_KERNEL_SPIN")) spin_us_ = std::max(0, std::atoi(env));
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { loop(); });
  }

  ~Pool() {
    stop_.store(true);
    {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      cv_.notify_all();
    }
    for (auto& t : workers_) t.join();
  }

  // Claim and run chunks of job ``gen`` until none is left (or another job has started).
  void work(uint64_t gen) {
    uint64_t v = next_.load(std::memory_order_acquire);
    while ((v >> 32) == gen) {
      const int64_t index = static_cast<int64_t>(v & 0xffffffffu);
      if (index >= total_) return;
      if (next_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel)) {
        fn_(ctx_, index);
        done_.fetch_add(1, std::memory_order_release);
        v = next_.load(std::memory_order_acquire);
      }
    }
  }

  void loop() {
    uint64_t seen = 0;
    while (!stop_.load()) {
      uint64_t gen = next_.load(std::memory_order_acquire) >> 32;
      if (gen == seen && spin_us_ > 0) {
        const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
        while (gen == seen && !stop_.load(std::memory_order_relaxed)) {
          for (int i = 0; i < 16 && gen == seen; ++i) {
            _mm_pause();
            gen = next_.load(std::memory_order_acquire) >> 32;
          }
          if (gen == seen && std::chrono::steady_clock::now() >= until) break;
          if (gen == seen) sched_yield();  // a runnable thread of any process comes first
        }
      }
      if (gen == seen) {
        std::unique_lock<std::mutex> lock(sleep_mutex_);
        sleepers_.fetch_add(1);
        cv_.wait(lock, [&] { return stop_.load() || (next_.load() >> 32) != seen; });
        sleepers_.fetch_sub(1);
        continue;
      }
      seen = gen;
      work(gen);
    }
  }

  std::vector<std::thread> workers_;
  std::mutex run_mutex_, sleep_mutex_;
  std::condition_variable cv_;
  std::atomic<uint64_t> next_{0};  // (generation << 32) | next chunk index
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  // Generations are compared as the claim word holds them (its upper 32 bits), so the counter
  // wraps at 32 bits: a 64-bit count past 2^32 would never again equal the word's generation
  // and the caller would wait forever (after ~2^31 jobs: days of serving).
  uint32_t generation_ = 0;
  int spin_us_ = kDefaultSpinMicros;  // FD_CPU_KERNEL_SPIN: how long an idle worker spins before sleeping
  void (*fn_)(void*, int64_t) = nullptr;
  void* ctx_ = nullptr;
  int64_t total_ = 0;
};

}  // namespace fd_kernels
