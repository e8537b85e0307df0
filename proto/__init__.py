"""Wire types shared by the server and the client: the generated stubs and the tensor codec.

Both sides import from here and nowhere else, so the contract has one home.
"""

from proctor.proto import scoring_pb2, scoring_pb2_grpc
from proctor.proto.codec import (
    WIRE_DTYPES,
    decode_tensor,
    encode_tensor,
    iter_row_chunks,
    rows_per_chunk,
)

__all__ = [
    "WIRE_DTYPES",
    "decode_tensor",
    "encode_tensor",
    "iter_row_chunks",
    "rows_per_chunk",
    "scoring_pb2",
    "scoring_pb2_grpc",
]
