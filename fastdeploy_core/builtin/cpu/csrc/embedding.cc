// Token embedding lookups, so a decode step's first op is one of this library's (and a captured
// graph, see graph.h, can start from the token ids):
//
//   fd_embedding(ids int64 [T], table float32 [V, H])                          -> float32 [T, H]
//   fd_int8_embedding(ids int64 [T], table int8 [V, H], scale float32 [V, G],
//                     group_size)                                             -> float32 [T, H]
//
// The int8 form widens only the looked-up rows: out[t, k] = table[id, k] * scale[id, k / group].
// Ids outside [0, V) are an error, as in Paddle's index_select.
#include <cstdint>
#include <cstring>
#include <vector>

#include "graph.h"
#include "paddle/extension.h"

namespace {

void check_ids(const paddle::Tensor& ids, const paddle::Tensor& table) {
  PD_CHECK(ids.dtype() == paddle::DataType::INT64 && ids.shape().size() == 1, "ids must be int64 [T]");
  PD_CHECK(table.shape().size() == 2, "the embedding table must be [vocab, hidden]");
}

const int64_t* checked_ids(const paddle::Tensor& ids, int64_t vocab) {
  const int64_t* id = ids.data<int64_t>();
  for (int64_t t = 0; t < ids.numel(); ++t)
    PD_CHECK(id[t] >= 0 && id[t] < vocab, "token id ", id[t], " outside the vocabulary of ", vocab);
  return id;
}

}  // namespace

std::vector<paddle::Tensor> Embedding(const paddle::Tensor& ids, const paddle::Tensor& table) {
  check_ids(ids, table);
  PD_CHECK(table.dtype() == paddle::DataType::FLOAT32, "fd_embedding takes a float32 table");
  const int64_t T = ids.numel(), V = table.shape()[0], H = table.shape()[1];
  auto out = fd_graph::empty({T, H}, paddle::DataType::FLOAT32);
  fd_graph::run("fd_embedding", {&ids, &table}, {&out}, [=]() mutable {
    const int64_t* id = checked_ids(ids, V);
    const float* src = table.data<float>();
    float* dst = out.data<float>();
    for (int64_t t = 0; t < T; ++t) std::memcpy(dst + t * H, src + id[t] * H, H * sizeof(float));
  });
  return {out};
}

std::vector<paddle::Tensor> Int8Embedding(const paddle::Tensor& ids, const paddle::Tensor& table,
                                          const paddle::Tensor& scale, int64_t group_size) {
  check_ids(ids, table);
  PD_CHECK(table.dtype() == paddle::DataType::INT8, "fd_int8_embedding takes an int8 table");
  const int64_t T = ids.numel(), V = table.shape()[0], H = table.shape()[1];
  PD_CHECK(group_size >= 1, "group_size must be positive");
  const int64_t G = (H + group_size - 1) / group_size;
  PD_CHECK(scale.dtype() == paddle::DataType::FLOAT32 && scale.shape().size() == 2 && scale.shape()[0] == V &&
               scale.shape()[1] == G,
           "scale must be float32 [vocab, ", G, "] for rows of ", H, " in groups of ", group_size);
  auto out = fd_graph::empty({T, H}, paddle::DataType::FLOAT32);
  fd_graph::run("fd_int8_embedding", {&ids, &table, &scale}, {&out}, [=]() mutable {
    const int64_t* id = checked_ids(ids, V);
    const int8_t* src = table.data<int8_t>();
    const float* s = scale.data<float>();
    float* dst = out.data<float>();
    for (int64_t t = 0; t < T; ++t) {
      const int8_t* row = src + id[t] * H;
      const float* row_scale = s + id[t] * G;
      float* o = dst + t * H;
      for (int64_t k = 0; k < H; ++k) o[k] = static_cast<float>(row[k]) * row_scale[k / group_size];
    }
  });
  return {out};
}

std::vector<std::vector<int64_t>> EmbeddingShape(const std::vector<int64_t>& ids, const std::vector<int64_t>& table) {
  return {{ids[0], table[1]}};
}

std::vector<std::vector<int64_t>> Int8EmbeddingShape(const std::vector<int64_t>& ids, const std::vector<int64_t>& table,
                                                     const std::vector<int64_t>&, int64_t) {
  return {{ids[0], table[1]}};
}

std::vector<paddle::DataType> EmbeddingDtype(const paddle::DataType&, const paddle::DataType&) {
  return {paddle::DataType::FLOAT32};
}

std::vector<paddle::DataType> Int8EmbeddingDtype(const paddle::DataType&, const paddle::DataType&,
                                                 const paddle::DataType&) {
  return {paddle::DataType::FLOAT32};
}

PD_BUILD_OP(fd_embedding)
    .Inputs({"Ids", "Table"})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(Embedding))
    .SetInferShapeFn(PD_INFER_SHAPE(EmbeddingShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(EmbeddingDtype));

PD_BUILD_OP(fd_int8_embedding)
    .Inputs({"Ids", "Table", "Scale"})
    .Outputs({"Out"})
    .Attrs({"group_size: int64_t"})
    .SetKernelFn(PD_KERNEL(Int8Embedding))
    .SetInferShapeFn(PD_INFER_SHAPE(Int8EmbeddingShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(Int8EmbeddingDtype));
