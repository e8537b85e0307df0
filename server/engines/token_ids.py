"""Token ids in their one form from the wire to the engine: a C-contiguous numpy int32 array
(why that form: `engines.base`, above `EngineRequest`).

`token_array` makes it (and is a no-op, the same array, for ids already in it); `index_tensor`
is the one conversion the torch-based code makes at torch's boundary, where an index must be
int64 (`gather`, `index_select`). vLLM takes its prompt as a list (`.tolist()` at its call).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

TOKEN_DTYPE = np.dtype(np.int32)


def token_array(ids: Any) -> np.ndarray:
    """`ids` (an array, a tensor, a list, a protobuf repeated field) as the one form; the same
    object, uncopied, when it already is."""
    return np.ascontiguousarray(ids, dtype=TOKEN_DTYPE)


def index_tensor(ids: np.ndarray) -> torch.Tensor:
    """Ids as torch indexes with them: int64, a new tensor (the widening is the copy)."""
    return torch.from_numpy(ids.astype(np.int64))
