"""Unpack a code bundle (tar.gz) so that nothing lands outside the target folder.

``extract_bundle(source, dest)`` extracts with ``tarfile``'s ``data`` filter: members with
``..`` or absolute names (which the filter alone would make relative), symlinks and hard links
that point out of ``dest`` (and so files written through them), device nodes and FIFOs are
refused; modes lose setuid/setgid and group/other write bits. ``source`` is a path or a binary file object. A refused member raises
``BundleRefused`` (a ``ValueError``) naming it and why, before anything of it is written; a
broken archive raises ``tarfile.TarError``. Blocks for the extraction. Used by the agent, the
Slurm executor and the client alike.
"""
from __future__ import annotations

import os
import tarfile
from typing import IO


class BundleRefused(ValueError):
    """A bundle member would land outside the target folder or is not a plain file, folder or link."""


def _data_not_absolute(member: tarfile.TarInfo, dest_path: str) -> tarfile.TarInfo | None:
    """``tarfile.data_filter``, and an absolute member is refused rather than made relative."""
    if member.name.startswith(("/", os.sep)):
        raise tarfile.AbsolutePathError(member)
    return tarfile.data_filter(member, dest_path)


def extract_bundle(source: str | os.PathLike | IO[bytes], dest: str | os.PathLike) -> None:
    """Extract the tar.gz ``source`` into ``dest`` (see the module docstring)."""
    opened = tarfile.open(fileobj=source, mode="r:gz") if hasattr(source, "read") else \
        tarfile.open(os.fspath(source), mode="r:gz")  # type: ignore[arg-type]
    with opened as tar:
        try:
            tar.extractall(dest, filter=_data_not_absolute)
        except tarfile.FilterError as exc:
            member = getattr(exc, "tarinfo", None)
            name = member.name if member is not None else "?"
            raise BundleRefused(f"bundle member {name!r} is refused: {exc}; a bundle may hold only plain "
                                "files, folders and links that stay inside its folder") from None
