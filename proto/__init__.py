"""Wire types shared by the server and the client: the generated stubs and the tensor codec.

Both sides import from here and nowhere else, so the contract has one home.
"""

from proctor.proto import scoring_pb2, scoring_pb2_grpc
from proctor.proto.codec import (
    DTYPES,
    WIRE_DTYPES,
    decode_tensor,
    dtype_name,
    encode_tensor,
    iter_row_chunks,
    rows_per_chunk,
    torch_dtype,
    wire_dtype,
)

__all__ = [
    "DTYPES",
    "WIRE_DTYPES",
    "decode_tensor",
    "dtype_name",
    "encode_tensor",
    "iter_row_chunks",
    "rows_per_chunk",
    "scoring_pb2",
    "scoring_pb2_grpc",
    "torch_dtype",
    "wire_dtype",
]
