// Captured op sequences: the cpu device's counterpart of CUDA graphs.
//
// A batch-1 decode step of a 30-layer model makes ~240 calls into this library, and Paddle's
// custom-op dispatch plus the Python layers around each call cost ~8 us: ~2 ms of a ~8 ms
// int4 step. While a graph is being recorded (fd_graph_begin .. fd_graph_end, see graph.cc),
// every op of this library that calls `fd_graph::run` also keeps its computation, a closure
// holding the very tensors it read and wrote, so fd_graph_replay can run the whole sequence
// again from C++ on the same buffers: the caller refreshes the static inputs in place (token
// ids, positions, slots, block tables, sequence lengths) and replays.
//
// Only the computation is replayed; whatever the caller did in Python or through Paddle's own
// ops is not. So recording checks that every input of every recorded op is either a tensor
// declared static when recording began (weights, KV caches, the step inputs) or the output of
// an earlier recorded op; anything else means some other op produced it, and fd_graph_end
// refuses the graph (the caller then stays eager). Everything a closure computes from tensor
// *data* (work splits from sequence lengths, bound checks) runs inside the closure, at replay
// time; only shape-derived values are fixed at capture.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "paddle/extension.h"

namespace fd_graph {

struct Range {
  uintptr_t begin, end;
};

struct Graph {
  std::vector<std::function<void()>> steps;
  std::vector<Range> statics;  // declared when recording began
  std::vector<Range> outputs;  // written by recorded steps
  std::vector<paddle::Tensor> keep;  // the static tensors, alive as long as the graph
  std::string error;           // the first reason this recording cannot be replayed
};

// The graph being recorded, or nullptr. Recording happens on the thread that calls the ops.
inline Graph*& recording() {
  static Graph* graph = nullptr;
  return graph;
}

inline int64_t element_bytes(paddle::DataType dtype) {
  switch (dtype) {
    case paddle::DataType::FLOAT64:
    case paddle::DataType::INT64:
      return 8;
    case paddle::DataType::FLOAT32:
    case paddle::DataType::INT32:
      return 4;
    case paddle::DataType::FLOAT16:
    case paddle::DataType::BFLOAT16:
    case paddle::DataType::INT16:
      return 2;
    default:
      return 1;
  }
}

inline Range range_of(const paddle::Tensor& t) {
  const auto begin = reinterpret_cast<uintptr_t>(t.data());
  return {begin, begin + static_cast<uintptr_t>(t.numel() * element_bytes(t.dtype()))};
}

inline bool within(const std::vector<Range>& ranges, const Range& r) {
  for (const Range& owned : ranges)
    if (owned.begin <= r.begin && r.end <= owned.end) return true;
  return false;
}

// Whether a recorded step may read `t`: empty, static, or an earlier step's output.
inline bool owned(const Graph& g, const paddle::Tensor& t) {
  if (!t.initialized() || t.numel() == 0) return true;
  const Range r = range_of(t);
  return within(g.statics, r) || within(g.outputs, r);
}

// Runs `step` now. While a graph is recorded, also checks `inputs` (see owned) and keeps the
// step (a copy of the closure, with the tensors it captured) for replay. `step` must read its
// inputs' data only when it runs.
template <class Step>
void run(const char* op, std::initializer_list<const paddle::Tensor*> inputs,
         std::initializer_list<const paddle::Tensor*> outputs, Step&& step) {
  if (Graph* g = recording()) {
    for (const paddle::Tensor* t : inputs)
      if (g->error.empty() && !owned(*g, *t))
        g->error = std::string(op) +
                   " read a tensor that is neither declared static nor written by an earlier op of this "
                   "library (another op, e.g. one of Paddle's, ran inside the captured forward)";
    for (const paddle::Tensor* t : outputs)
      if (t->initialized() && t->numel() > 0) g->outputs.push_back(range_of(*t));
    g->steps.emplace_back(step);
  }
  step();
}

}  // namespace fd_graph
