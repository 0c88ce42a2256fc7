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
// Memory: a first recording notes every output the ops allocate through fd_graph::empty and the
// last step that reads it; fd_graph_end turns that into a plan (offsets in one arena where
// outputs whose lifetimes do not overlap share bytes) and drops the steps and their buffers. A second recording of the same work (the
// next step of that batch size: fd_graph_begin with the first graph's handle as `plan`)
// allocates its outputs at those offsets, so a replayed step's activations take a few layers'
// worth of memory and stay warm in cache, instead of one buffer per op.
//
// Only the computation is replayed; whatever the caller did in Python or through Paddle's own
// ops is not. So recording checks that every input of every recorded op is either a tensor
// declared static when recording began (weights, KV caches, the step inputs) or the output of
// an earlier recorded op; anything else means some other op produced it, and fd_graph_end
// refuses the graph (the caller then stays eager). Everything a closure computes from tensor
// *data* (work splits from sequence lengths, bound checks) runs inside the closure, at replay
// time; only shape-derived values are fixed at capture.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "paddle/extension.h"
#include "paddle/phi/api/include/tensor_utils.h"

namespace fd_graph {

struct Range {
  uintptr_t begin, end;
};

// Page-aligned bytes for a planned graph's activations.
struct Arena {
  explicit Arena(size_t bytes) : data(static_cast<uint8_t*>(std::aligned_alloc(4096, std::max<size_t>(4096, (bytes + 4095) / 4096 * 4096)))) {}
  ~Arena() { std::free(data); }
  uint8_t* data;
};

struct Graph {
  std::vector<std::function<void()>> steps;
  std::vector<Range> statics;  // declared when recording began
  std::vector<Range> outputs;  // written by recorded steps
  std::vector<paddle::Tensor> keep;  // the static tensors, alive as long as the graph
  std::string error;           // the first reason this recording cannot be replayed
  // First recording: each fd_graph::empty allocation, the step count when it was made (its
  // birth) and the last step that read it (its death).
  std::vector<Range> allocs;
  std::vector<int64_t> born, last_read;
  // Second recording: where each allocation goes in the arena.
  std::vector<int64_t> offsets;
  std::shared_ptr<Arena> arena;  // freed with the graph: only its steps hold tensors on it
  int64_t arena_bytes = 0;
  int64_t keep_alive = -1;
  bool plan_only = false;  // a first recording after fd_graph_end: the plan, no steps  // the allocation of the forward's output: a normal tensor, not on the arena
  size_t next_alloc = 0;
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

inline int64_t bytes_of(const std::vector<int64_t>& shape, paddle::DataType dtype) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n * element_bytes(dtype);
}

// An op's output tensor: paddle::empty, except while a planned graph is recorded (see the
// file comment), when it is the next planned place in that graph's arena.
inline paddle::Tensor empty(const std::vector<int64_t>& shape, paddle::DataType dtype) {
  Graph* g = recording();
  if (g == nullptr || !g->arena) {
    paddle::Tensor t = paddle::empty(shape, dtype, paddle::CPUPlace());
    if (g != nullptr && t.numel() > 0) {
      g->allocs.push_back(range_of(t));
      g->born.push_back(static_cast<int64_t>(g->steps.size()));
      g->last_read.push_back(static_cast<int64_t>(g->steps.size()));
    }
    return t;
  }
  if (bytes_of(shape, dtype) == 0) return paddle::empty(shape, dtype, paddle::CPUPlace());
  const size_t i = g->next_alloc++;
  PD_CHECK(i < g->offsets.size() &&
               static_cast<int64_t>(g->allocs[i].end - g->allocs[i].begin) == bytes_of(shape, dtype),
           "graph capture: the forward allocated differently from its planning run");
  // The output leaves with the caller, who may keep it after the graph is released.
  if (static_cast<int64_t>(i) == g->keep_alive) return paddle::empty(shape, dtype, paddle::CPUPlace());
  // No deleter: Paddle keys deleters by pointer, and arena places are shared by design.
  return paddle::from_blob(g->arena->data + g->offsets[i], phi::IntArray(shape), dtype, phi::DataLayout::NCHW,
                           paddle::CPUPlace());
}

// The arena offsets of a first recording's allocations: the largest first, each at the lowest
// 64-byte-aligned offset where it overlaps no placed allocation that is alive at the same time
// (`keep_alive`, the forward's output, is left out: it is allocated normally). Returns the
// arena's size.
inline int64_t plan_arena(const Graph& g, int64_t keep_alive, std::vector<int64_t>* offsets) {
  const size_t n = g.allocs.size();
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  auto size = [&](size_t i) { return static_cast<int64_t>((g.allocs[i].end - g.allocs[i].begin + 63) / 64 * 64); };
  auto death = [&](size_t i) { return g.last_read[i]; };
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return size(a) > size(b); });
  offsets->assign(n, 0);
  std::vector<size_t> placed;
  int64_t total = 0;
  for (size_t i : order) {
    if (static_cast<int64_t>(i) == keep_alive) continue;  // a normal tensor (see empty)
    std::vector<std::pair<int64_t, int64_t>> busy;  // [offset, end) of overlapping lifetimes
    for (size_t j : placed)
      if (g.born[i] <= death(j) && g.born[j] <= death(i)) busy.emplace_back((*offsets)[j], (*offsets)[j] + size(j));
    std::sort(busy.begin(), busy.end());
    int64_t at = 0;
    for (const auto& b : busy) {
      if (at + size(i) <= b.first) break;
      at = std::max(at, b.second);
    }
    (*offsets)[i] = at;
    total = std::max(total, at + size(i));
    placed.push_back(i);
  }
  return total;
}

// Runs `step` now. While a graph is recorded, also checks `inputs` (see owned) and keeps the
// step (a copy of the closure, with the tensors it captured) for replay. `step` must read its
// inputs' data only when it runs.
template <class Step>
void run(const char* op, std::initializer_list<const paddle::Tensor*> inputs,
         std::initializer_list<const paddle::Tensor*> outputs, Step&& step) {
  if (Graph* g = recording()) {
    const int64_t now = static_cast<int64_t>(g->steps.size());
    for (const paddle::Tensor* t : inputs) {
      if (g->error.empty() && !owned(*g, *t))
        g->error = std::string(op) +
                   " read a tensor that is neither declared static nor written by an earlier op of this "
                   "library (another op, e.g. one of Paddle's, ran inside the captured forward)";
      if (!g->arena && t->initialized() && t->numel() > 0) {
        const Range r = range_of(*t);
        for (size_t i = 0; i < g->allocs.size(); ++i)
          if (g->allocs[i].begin <= r.begin && r.end <= g->allocs[i].end) g->last_read[i] = now;
      }
    }
    for (const paddle::Tensor* t : outputs)
      if (t->initialized() && t->numel() > 0) g->outputs.push_back(range_of(*t));
    g->steps.emplace_back(step);
  }
  step();
}

}  // namespace fd_graph
