"""Open a store URL: the fsspec file system, its root, and the backend that writes on it.

``open_store(url, options, env)`` raises ``StorageError`` at once, before any request, when the
scheme has no fsspec implementation installed (naming the package to install), when fsspec
knows no such scheme, when the URL holds a password, or when the file system cannot be made
(a bad option). Whether the store answers is ``ArtifactStore.check()``'s question.
"""
from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any, Mapping

import fsspec
from fsspec.implementations.local import LocalFileSystem

from torchrelay.errors import StorageError
from torchrelay.storage.backend import Backend
from torchrelay.storage.failures import describe_os_error, redact
from torchrelay.storage.hdfs import WebHdfsBackend
from torchrelay.storage.local import LocalBackend
from torchrelay.storage.options import (OBJECT_STORE_SCHEMES, missing_package, refuse_credentials_in_url,
                                        s3fs_kwargs, secrets_of)
from torchrelay.storage.s3 import S3Backend


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class OpenedStore:
    fs: Any
    root: str
    protocol: str
    local: bool
    backend: Backend
    secrets: tuple[str, ...]  # values to keep out of every message


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def open_store(url: str, options: Mapping[str, Any], env: Mapping[str, str]) -> OpenedStore:
    """The file system behind ``url`` (see the module docstring). Raises ``StorageError``."""
    refuse_credentials_in_url(url)
    protocol = fsspec.utils.get_protocol(url)
    package = missing_package(protocol, _installed)
    if package:
        raise StorageError(f"the store {url} needs {package}: no fsspec implementation of {protocol}:// "
                           "is installed")
    secrets = tuple(secrets_of(options, env))
    kwargs = s3fs_kwargs(options, env) if protocol in OBJECT_STORE_SCHEMES else dict(options)
    try:
        fs, root = fsspec.core.url_to_fs(url, **kwargs)
    except ValueError as exc:  # fsspec: "Protocol not known: …"
        raise StorageError(f"the store {url} has a scheme no fsspec implementation knows "
                           f"({redact(str(exc), secrets)})") from None
    except ImportError as exc:
        raise StorageError(f"the store {url} needs a package that is missing: {redact(str(exc), secrets)}") from None
    except (OSError, TypeError) as exc:
        raise StorageError(f"cannot open the store {url}: {redact(describe_os_error(exc), secrets)}") from None
    local = isinstance(fs, LocalFileSystem)
    if local:
        backend: Backend = LocalBackend(fs)
    elif protocol in OBJECT_STORE_SCHEMES:
        backend = S3Backend(fs, root)
    elif protocol in ("webhdfs", "swebhdfs"):
        backend = WebHdfsBackend(fs)
    else:
        backend = Backend(fs)
    return OpenedStore(fs=fs, root=root, protocol=protocol, local=local, backend=backend, secrets=secrets)
