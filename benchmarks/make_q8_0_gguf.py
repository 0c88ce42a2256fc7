"""Write a Q8_0 copy of a Q4_0/Q4_1 GGUF (the peer comparison's llama.cpp Q8_0 model).

Usage: python benchmarks/make_q8_0_gguf.py SRC.gguf DST.gguf

Q4 tensors are dequantized and requantized to Q8_0 with gguf-py; everything else (metadata,
tokenizer, F32 and Q8_0 tensors) is copied as is. Not part of the test suite.
"""

import sys, numpy as np, gguf
from gguf import GGUFReader, GGUFWriter, GGMLQuantizationType as T, quants
src, dst = sys.argv[1], sys.argv[2]
r = GGUFReader(src)
arch = r.fields["general.architecture"].contents()
w = GGUFWriter(dst, arch)
for key, field in r.fields.items():
    if key.startswith("GGUF.") or key == "general.architecture":
        continue
    vt = field.types[0]
    if vt == gguf.GGUFValueType.ARRAY:
        w.add_key_value(key, field.contents(), vt, sub_type=field.types[-1])
    else:
        w.add_key_value(key, field.contents(), vt)
for t in r.tensors:
    shape = tuple(int(d) for d in reversed(t.shape))
    if t.tensor_type in (T.Q4_1, T.Q4_0):
        data = quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        q = quants.quantize(data, T.Q8_0)
        w.add_tensor(t.name, q, raw_shape=q.shape, raw_dtype=T.Q8_0)
    else:
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=np.asarray(t.data).shape, raw_dtype=t.tensor_type)
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
print("ok")
