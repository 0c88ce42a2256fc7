// The graph ops: begin and end a recording, replay it, release it (see graph.h).
//
//   fd_graph_begin(static tensors, plan) -> int64 [1] (0); plan: 0, or the handle of a first
//                                      recording of the same forward whose arena plan to use
//   ... the forward, whose ops of this library record themselves ...
//   fd_graph_end(forward's output)  -> int64 [1]: the graph's handle; raises with the reason
//                                      when the recording cannot be replayed. A first recording
//                                      (plan 0) keeps only its memory plan, not its steps
//   fd_graph_replay(handle)         -> int64 [1]: the handle (runs every recorded step)
//   fd_graph_arena_bytes(handle)    -> int64 [1]: bytes of a planned graph's activation arena
//   fd_graph_release(handle)        -> int64 [1]: 1 if a graph was released
//   fd_graph_abort(any)             -> int64 [1]: 1 if a recording was dropped (after an error)
#include <map>
#include <memory>
#include <mutex>

#include "graph.h"

namespace {

struct Registry {
  std::mutex mutex;
  std::map<int64_t, std::shared_ptr<fd_graph::Graph>> graphs;
  int64_t next = 1;
};

Registry& registry() {
  static Registry r;
  return r;
}

paddle::Tensor scalar(int64_t value) {
  auto out = paddle::empty({1}, paddle::DataType::INT64, paddle::CPUPlace());
  *out.data<int64_t>() = value;
  return out;
}

int64_t handle_of(const paddle::Tensor& handle) {
  PD_CHECK(handle.dtype() == paddle::DataType::INT64 && handle.numel() == 1, "a graph handle is int64 [1]");
  return *handle.data<int64_t>();
}

std::shared_ptr<fd_graph::Graph> find(int64_t id) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.graphs.find(id);
  PD_CHECK(it != r.graphs.end(), "no captured graph ", id, " (released, or never captured)");
  return it->second;
}

}  // namespace

std::vector<paddle::Tensor> GraphBegin(const std::vector<paddle::Tensor>& statics, int64_t plan) {
  PD_CHECK(fd_graph::recording() == nullptr, "a graph is already being recorded; end or abort it first");
  std::unique_ptr<fd_graph::Graph> g(new fd_graph::Graph);
  if (plan != 0) {
    const std::shared_ptr<fd_graph::Graph> first = find(plan);
    PD_CHECK(!first->arena && first->offsets.size() == first->allocs.size(), "graph ", plan,
             " is not a first recording with a plan");
    g->allocs = first->allocs;
    g->offsets = first->offsets;
    g->arena = std::make_shared<fd_graph::Arena>(static_cast<size_t>(first->arena_bytes));
    g->arena_bytes = first->arena_bytes;
    g->keep_alive = first->keep_alive;
    PD_CHECK(g->arena->data != nullptr, "graph capture: cannot allocate ", first->arena_bytes, " bytes");
  }
  for (const paddle::Tensor& t : statics) {
    if (!t.initialized() || t.numel() == 0) continue;
    PD_CHECK(t.is_cpu(), "graph capture on this library's kernels takes cpu tensors only");
    g->statics.push_back(fd_graph::range_of(t));
    g->keep.push_back(t);
  }
  fd_graph::recording() = g.release();
  return {scalar(0)};
}

std::vector<paddle::Tensor> GraphEnd(const paddle::Tensor& output) {
  std::unique_ptr<fd_graph::Graph> g(fd_graph::recording());
  fd_graph::recording() = nullptr;
  PD_CHECK(g != nullptr, "no graph is being recorded");
  if (g->error.empty() && g->steps.empty()) g->error = "the forward ran no op of this library";
  if (g->error.empty() && !(output.initialized() && fd_graph::within(g->outputs, fd_graph::range_of(output))))
    g->error = "the forward's result was not written by an op of this library";
  if (g->error.empty() && g->arena && g->next_alloc != g->offsets.size())
    g->error = "the forward allocated differently from its planning run";
  PD_CHECK(g->error.empty(), "graph capture failed: ", g->error);
  if (!g->arena) {  // a first recording: plan the arena a second one can use
    const fd_graph::Range out = fd_graph::range_of(output);
    int64_t keep_alive = -1;
    for (size_t i = 0; i < g->allocs.size(); ++i)
      if (g->allocs[i].begin <= out.begin && out.end <= g->allocs[i].end) keep_alive = static_cast<int64_t>(i);
    g->keep_alive = keep_alive;
    g->arena_bytes = fd_graph::plan_arena(*g, keep_alive, &g->offsets);
    // Keep only the plan: the steps would hold one buffer per op until the second recording.
    g->steps.clear();
    g->keep.clear();
    g->plan_only = true;
  }
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const int64_t id = r.next++;
  r.graphs[id] = std::shared_ptr<fd_graph::Graph>(g.release());
  return {scalar(id)};
}

std::vector<paddle::Tensor> GraphReplay(const paddle::Tensor& handle) {
  PD_CHECK(fd_graph::recording() == nullptr, "cannot replay a graph while recording one");
  const int64_t id = handle_of(handle);
  const std::shared_ptr<fd_graph::Graph> g = find(id);
  PD_CHECK(!g->plan_only, "graph ", id, " holds only a memory plan: record the forward again with it as `plan`");
  for (const auto& step : g->steps) step();
  return {scalar(id)};
}

std::vector<paddle::Tensor> GraphArenaBytes(const paddle::Tensor& handle) {
  const std::shared_ptr<fd_graph::Graph> g = find(handle_of(handle));
  return {scalar(g->arena ? g->arena_bytes : 0)};
}

std::vector<paddle::Tensor> GraphRelease(const paddle::Tensor& handle) {
  const int64_t id = handle_of(handle);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return {scalar(static_cast<int64_t>(r.graphs.erase(id)))};
}

std::vector<paddle::Tensor> GraphAbort(const paddle::Tensor&) {
  fd_graph::Graph* g = fd_graph::recording();
  fd_graph::recording() = nullptr;
  delete g;
  return {scalar(g != nullptr ? 1 : 0)};
}

std::vector<std::vector<int64_t>> GraphBeginShape(const std::vector<std::vector<int64_t>>&, int64_t) { return {{1}}; }
std::vector<paddle::DataType> GraphBeginDtype(const std::vector<paddle::DataType>&) {
  return {paddle::DataType::INT64};
}
std::vector<std::vector<int64_t>> GraphHandleShape(const std::vector<int64_t>&) { return {{1}}; }
std::vector<paddle::DataType> GraphHandleDtype(const paddle::DataType&) { return {paddle::DataType::INT64}; }

PD_BUILD_OP(fd_graph_begin)
    .Inputs({paddle::Vec("Static")})
    .Outputs({"Out"})
    .Attrs({"plan: int64_t"})
    .SetKernelFn(PD_KERNEL(GraphBegin))
    .SetInferShapeFn(PD_INFER_SHAPE(GraphBeginShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(GraphBeginDtype));

PD_BUILD_OP(fd_graph_end)
    .Inputs({"Output"})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(GraphEnd))
    .SetInferShapeFn(PD_INFER_SHAPE(GraphHandleShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(GraphHandleDtype));

PD_BUILD_OP(fd_graph_replay)
    .Inputs({"Handle"})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(GraphReplay))
    .SetInferShapeFn(PD_INFER_SHAPE(GraphHandleShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(GraphHandleDtype));

PD_BUILD_OP(fd_graph_arena_bytes)
    .Inputs({"Handle"})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(GraphArenaBytes))
    .SetInferShapeFn(PD_INFER_SHAPE(GraphHandleShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(GraphHandleDtype));

PD_BUILD_OP(fd_graph_release)
    .Inputs({"Handle"})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(GraphRelease))
    .SetInferShapeFn(PD_INFER_SHAPE(GraphHandleShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(GraphHandleDtype));

PD_BUILD_OP(fd_graph_abort)
    .Inputs({"Any"})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(GraphAbort))
    .SetInferShapeFn(PD_INFER_SHAPE(GraphHandleShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(GraphHandleDtype));
