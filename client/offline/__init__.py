"""Offline teacher signals: a dataset scored once through a running teacher, stored small and
resumably as Parquet shards, and read back for training with the same tensors as online.

`job` (the `proctor score-dataset` job, a client of the service) and `ray_job` (the same job on
Ray Data) write shards (`shards`, in the forms of `codecs`, carrying an `identity`) into a
directory `store` keeps (manifest, resume rule); `reader` gives torch and Hugging Face datasets
over it; `verify` re-scores a sample against a live teacher; `inputs` reads the input dataset.
"""

from proctor.client.offline.identity import DatasetIdentity, IdentityMismatch
from proctor.client.offline.job import JobReport, JobSettings, run_job
from proctor.client.offline.reader import OfflineScores, OfflineStream, hf_dataset, packed_scores
from proctor.client.offline.shards import StoredSequence

__all__ = [
    "DatasetIdentity",
    "IdentityMismatch",
    "JobReport",
    "JobSettings",
    "OfflineScores",
    "OfflineStream",
    "StoredSequence",
    "hf_dataset",
    "packed_scores",
    "run_job",
]
