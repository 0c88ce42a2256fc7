// The graph ops: begin and end a recording, replay it, release it (see graph.h).
//
//   fd_graph_begin(static tensors)  -> int64 [1] (0)
//   ... the forward, whose ops of this library record themselves ...
//   fd_graph_end(forward's output)  -> int64 [1]: the graph's handle; raises with the reason
//                                      when the recording cannot be replayed
//   fd_graph_replay(handle)         -> int64 [1]: the handle (runs every recorded step)
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

std::vector<paddle::Tensor> GraphBegin(const std::vector<paddle::Tensor>& statics) {
  PD_CHECK(fd_graph::recording() == nullptr, "a graph is already being recorded; end or abort it first");
  auto* g = new fd_graph::Graph;
  for (const paddle::Tensor& t : statics) {
    if (!t.initialized() || t.numel() == 0) continue;
    PD_CHECK(t.is_cpu(), "graph capture on this library's kernels takes cpu tensors only");
    g->statics.push_back(fd_graph::range_of(t));
    g->keep.push_back(t);
  }
  fd_graph::recording() = g;
  return {scalar(0)};
}

std::vector<paddle::Tensor> GraphEnd(const paddle::Tensor& output) {
  std::unique_ptr<fd_graph::Graph> g(fd_graph::recording());
  fd_graph::recording() = nullptr;
  PD_CHECK(g != nullptr, "no graph is being recorded");
  if (g->error.empty() && g->steps.empty()) g->error = "the forward ran no op of this library";
  if (g->error.empty() && !(output.initialized() && fd_graph::within(g->outputs, fd_graph::range_of(output))))
    g->error = "the forward's result was not written by an op of this library";
  PD_CHECK(g->error.empty(), "graph capture failed: ", g->error);
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
  for (const auto& step : g->steps) step();
  return {scalar(id)};
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

std::vector<std::vector<int64_t>> GraphBeginShape(const std::vector<std::vector<int64_t>>&) { return {{1}}; }
std::vector<paddle::DataType> GraphBeginDtype(const std::vector<paddle::DataType>&) {
  return {paddle::DataType::INT64};
}
std::vector<std::vector<int64_t>> GraphHandleShape(const std::vector<int64_t>&) { return {{1}}; }
std::vector<paddle::DataType> GraphHandleDtype(const paddle::DataType&) { return {paddle::DataType::INT64}; }

PD_BUILD_OP(fd_graph_begin)
    .Inputs({paddle::Vec("Static")})
    .Outputs({"Out"})
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
