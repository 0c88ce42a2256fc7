"""Write a Q8_0 copy of a Q4_0/Q4_1 GGUF (the peer comparison's llama.cpp Q8_0 model).

Usage: python benchmarks/make_q8_0_gguf.py SRC.gguf DST.gguf

Q4 tensors are dequantized and requantized to Q8_0 with gguf-py; everything else (metadata,
tokenizer, F32 and Q8_0 tensors) is copied as is. Not part of the test suite.
"""

import sys

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants


def main(src: str, dst: str) -> None:
    reader = GGUFReader(src)
    writer = GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value_type = field.types[0]
        if value_type == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, field.contents(), value_type, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, field.contents(), value_type)
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape))
        if tensor.tensor_type in (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_0):
            values = quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32)
            data = quants.quantize(values, GGMLQuantizationType.Q8_0)
            writer.add_tensor(tensor.name, data, raw_shape=data.shape, raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            data = np.asarray(tensor.data)
            writer.add_tensor(tensor.name, data, raw_shape=data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {dst}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
