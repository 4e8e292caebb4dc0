"""From a store URL and its options to what fsspec is given: the scheme's package, credentials, endpoint.

Pure: no I/O (the environment and "is this module installed" are arguments).
- ``missing_package(protocol, installed)``: the package to install when the scheme's fsspec
  implementation is not there (``s3`` -> ``s3fs``, ``hdfs`` -> ``pyarrow`` or ``hdfs-native``).
- ``refuse_credentials_in_url(url)``: a URL carries no password (the URL travels to every
  worker, in its environment; secrets go in the environment, ``~/.aws`` or the store options).
- ``public_options(options)``: the options a worker may be told (where the store is, never who
  the server is to it): ``endpoint_url``, ``region``, ``addressing_style``. Workers bring their
  own credentials (their environment or ``~/.aws``).
- ``s3fs_kwargs(options, env)``: the keyword arguments of ``s3fs.S3FileSystem``. Anything not
  given is left to botocore, which reads ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/
  ``AWS_SESSION_TOKEN``/``AWS_PROFILE``/``AWS_ENDPOINT_URL``, ``~/.aws/config`` and
  ``~/.aws/credentials`` as the AWS tools do. Store options use these names (each optional):
  ``endpoint_url``, ``region``, ``access_key_id``, ``secret_access_key``, ``session_token``,
  ``profile``, ``addressing_style`` (``path`` or ``virtual``); any other option goes to
  ``S3FileSystem`` as it is.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping
from urllib.parse import urlsplit

from torchrelay.errors import StorageError

# scheme -> (modules any one of which provides it, what to install)
_IMPLEMENTATION_PACKAGES: dict[str, tuple[tuple[str, ...], str]] = {
    "s3": (("s3fs",), "s3fs (pip install 'torchrelay[s3]')"),
    "s3a": (("s3fs",), "s3fs (pip install 'torchrelay[s3]')"),
    "hdfs": (("pyarrow", "hdfs_native"), "hdfs-native (no Java; pip install 'torchrelay[hdfs]') or pyarrow "
             "(with Java's libhdfs)"),
    "arrow_hdfs": (("pyarrow",), "pyarrow"),
    "viewfs": (("hdfs_native",), "hdfs-native"),
    "webhdfs": (("requests",), "requests (pip install 'torchrelay[hdfs]')"),
    "swebhdfs": (("requests",), "requests (pip install 'torchrelay[hdfs]')"),
    "gs": (("gcsfs",), "gcsfs"),
    "gcs": (("gcsfs",), "gcsfs"),
    "abfs": (("adlfs",), "adlfs"),
    "az": (("adlfs",), "adlfs"),
    "sftp": (("paramiko",), "paramiko"),
}
OBJECT_STORE_SCHEMES = frozenset({"s3", "s3a"})

# friendly store option -> where it goes in S3FileSystem's arguments
_S3_TOP_LEVEL = {"endpoint_url": "endpoint_url", "access_key_id": "key", "secret_access_key": "secret",
                 "session_token": "token", "profile": "profile"}
SECRET_OPTIONS = ("secret_access_key", "session_token", "secret", "token")
SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
# named, not "all but the secrets": an option passed through to S3FileSystem (client_kwargs…)
# may hold a credential under a name of botocore's
PUBLIC_OPTIONS = ("endpoint_url", "region", "addressing_style")
# botocore waits 60 s to connect and retries: a store that is not there should say so sooner
_DEFAULT_CONNECT_TIMEOUT_S = 10


def missing_package(protocol: str, installed: Callable[[str], bool]) -> str | None:
    """What to install for ``protocol``, or None when it needs nothing more (or fsspec has it built in)."""
    modules, package = _IMPLEMENTATION_PACKAGES.get(protocol, ((), ""))
    if not modules or any(installed(module) for module in modules):
        return None
    return package


def refuse_credentials_in_url(url: str) -> None:
    """Raise ``StorageError`` if ``url`` holds a password (``scheme://user:secret@host/…``)."""
    if "://" not in url:
        return
    try:
        password = urlsplit(url).password
    except ValueError:
        return
    if password:
        scheme = url.split("://", 1)[0]
        raise StorageError(f"the {scheme}:// store URL holds a credential; give it in the environment, "
                           "~/.aws/credentials or the store options instead (the URL is passed to every worker)")


def public_options(options: Mapping[str, Any]) -> dict[str, str]:
    """The store options a worker is given (see the module docstring), as strings."""
    return {name: str(options[name]) for name in PUBLIC_OPTIONS if options.get(name) not in (None, "")}


def s3fs_kwargs(options: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """``S3FileSystem`` keyword arguments for store ``options`` (see the module docstring)."""
    kwargs: dict[str, Any] = {}
    client_kwargs = dict(options.get("client_kwargs") or {})
    config_kwargs = dict(options.get("config_kwargs") or {})
    for name, value in options.items():
        if name in _S3_TOP_LEVEL:
            if value is not None:
                kwargs[_S3_TOP_LEVEL[name]] = value
        elif name == "region":
            if value:
                client_kwargs["region_name"] = value
        elif name == "addressing_style":
            config_kwargs["s3"] = {**config_kwargs.get("s3", {}), "addressing_style": value}
        elif name not in ("client_kwargs", "config_kwargs"):
            kwargs[name] = value
    region = env.get("AWS_REGION")  # the AWS CLI reads it; botocore only AWS_DEFAULT_REGION
    if region and "region_name" not in client_kwargs and not env.get("AWS_DEFAULT_REGION"):
        client_kwargs["region_name"] = region
    endpoint = kwargs.get("endpoint_url") or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if endpoint and "addressing_style" not in config_kwargs.get("s3", {}):
        # an S3-compatible service (RGW, MinIO) seldom has wildcard DNS for virtual-hosted buckets
        config_kwargs["s3"] = {**config_kwargs.get("s3", {}), "addressing_style": "path"}
    config_kwargs.setdefault("connect_timeout", _DEFAULT_CONNECT_TIMEOUT_S)
    kwargs["client_kwargs"], kwargs["config_kwargs"] = client_kwargs, config_kwargs
    # other processes write the same keys: a cached listing would hide their writes
    kwargs.setdefault("use_listings_cache", False)
    # fsspec reuses an instance made with the same arguments, whatever the environment said then
    kwargs.setdefault("skip_instance_cache", True)
    return kwargs


def secrets_of(options: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    """The secret values a store knows of (to keep them out of messages)."""
    found = [str(options[name]) for name in SECRET_OPTIONS if options.get(name)]
    return found + [env[name] for name in SECRET_ENV if env.get(name)]
