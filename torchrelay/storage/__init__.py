"""The artifact store: one fsspec URL for bundles, artifacts, checkpoints and the attempt fence.

Rooms (each imports only those below it, and ``torchrelay.errors``):
- ``store``: ``ArtifactStore``, the facade every caller uses (see its contract there).
- ``connect``: a URL and options -> the fsspec file system, its root, and its backend.
- ``backend``, ``local``, ``s3``, ``hdfs``: how whole-file and conditional writes are made on a
  generic fsspec file system, a local/POSIX folder, an S3 store (no rename; conditional PUTs)
  and HDFS over WebHDFS (a rename that never replaces).
- ``options``, ``conditional``, ``keys``, ``failures``: pure: store options -> fsspec arguments
  and the package a scheme needs; what a probe found and the fence's decision; the key layout;
  error causes without secrets.

docs/storage.md says how to point a store at S3, Ceph RGW or MinIO and what is guaranteed where.
"""
from torchrelay.storage.conditional import Capabilities, EtagForm, Guarantee
from torchrelay.storage.failures import describe_os_error
from torchrelay.storage.keys import validate_relative_path
from torchrelay.storage.store import ArtifactStore

_describe = describe_os_error  # the name torchrelay.train.checkpoint_dcp imports

__all__ = ["ArtifactStore", "Capabilities", "EtagForm", "Guarantee", "describe_os_error", "validate_relative_path"]
