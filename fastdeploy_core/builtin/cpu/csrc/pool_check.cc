// fd_pool_check: a self-check of the shared thread pool (thread_pool.h), run by the tests.
//
// It runs ``iterations`` jobs back to back from C++ (no Python between them, so workers are
// still inside the previous job when the next one starts), with chunk counts that change from
// job to job, and counts how often each chunk ran. Every chunk of every job must run exactly
// once, with its own job's context, before ``run`` returns. Returns int64 [2]: chunks that ran
// other than once, and calls with an index outside their job.

#include <atomic>
#include <vector>

#include "paddle/extension.h"
#include "thread_pool.h"

namespace {

struct CheckJob {
  int64_t total;
  std::atomic<int>* hits;
  std::atomic<int64_t>* out_of_range;
};

void check_chunk(void* p, int64_t i) {
  auto* job = static_cast<CheckJob*>(p);
  if (i < 0 || i >= job->total) {
    job->out_of_range->fetch_add(1, std::memory_order_relaxed);
    return;
  }
  job->hits[i].fetch_add(1, std::memory_order_relaxed);
}

}  // namespace

std::vector<paddle::Tensor> PoolCheck(const paddle::Tensor& iterations) {
  PD_CHECK(iterations.is_cpu() && iterations.dtype() == paddle::DataType::INT64 && iterations.numel() == 1,
           "fd_pool_check takes a cpu int64 [1] iteration count");
  const int64_t n = iterations.data<int64_t>()[0];
  constexpr int64_t kTotals[] = {2, 64, 7, 3, 33};
  std::vector<std::atomic<int>> hits(64);
  std::atomic<int64_t> out_of_range{0};
  int64_t wrong = 0;
  for (int64_t it = 0; it < n; ++it) {
    const int64_t total = kTotals[it % 5];
    for (int64_t i = 0; i < total; ++i) hits[i].store(0, std::memory_order_relaxed);
    CheckJob job{total, hits.data(), &out_of_range};
    fd_kernels::Pool::instance().run(total, check_chunk, &job);
    for (int64_t i = 0; i < total; ++i) wrong += hits[i].load(std::memory_order_relaxed) != 1;
  }
  auto out = paddle::empty({2}, paddle::DataType::INT64, paddle::CPUPlace());
  out.data<int64_t>()[0] = wrong;
  out.data<int64_t>()[1] = out_of_range.load();
  return {out};
}

std::vector<std::vector<int64_t>> PoolCheckShape(const std::vector<int64_t>&) { return {{2}}; }

std::vector<paddle::DataType> PoolCheckDtype(const paddle::DataType&) { return {paddle::DataType::INT64}; }

PD_BUILD_OP(fd_pool_check)
    .Inputs({"Iterations"})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(PoolCheck))
    .SetInferShapeFn(PD_INFER_SHAPE(PoolCheckShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PoolCheckDtype));
