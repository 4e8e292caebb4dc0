"""Conditional writes: what a store guarantees, what a probe of it found, and the fence's decision.

Pure: no I/O, no clock. A store's backend probes its file system once (see
``ArtifactStore.capabilities``) and reports what the probe saw; ``s3_capabilities`` turns that
into ``Capabilities``. ``fence_step`` decides what ``advance_fence`` does with the attempt it
finds stored. Where a store offers no conditional write the operation is a check followed by a
write (``Guarantee.CHECK_THEN_WRITE``): a writer racing within that window can slip in between.
docs/storage.md says what that means for each use.
"""
from __future__ import annotations

import dataclasses
import enum


class Guarantee(enum.Enum):
    """How one conditional operation is carried out on a store."""

    ATOMIC = "atomic"  # one operation of the store decides (If-None-Match / If-Match, link(2), a lock)
    CHECK_THEN_WRITE = "check-then-write"  # a read, then a plain write: a racing writer can slip in


class EtagForm(enum.Enum):
    """How an S3 store wants the ETag in ``If-Match``."""

    QUOTED = "quoted"  # as the store hands it out, '"abc…"' (AWS S3, MinIO)
    BARE = "bare"  # without the quotes: Ceph RGW 16.2 answers 412 to a quoted one


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Capabilities:
    """What a store's conditional operations guarantee, as found by its probe."""

    put_if_absent: Guarantee  # write a key only if nothing is there
    compare_and_swap: Guarantee  # replace a key only if it still holds what was read
    etag_form: EtagForm | None = None  # S3 only: the form If-Match takes (None: If-Match unusable)

    def as_dict(self) -> dict[str, str | None]:
        return {"put_if_absent": self.put_if_absent.value, "compare_and_swap": self.compare_and_swap.value,
                "etag_form": self.etag_form.value if self.etag_form else None}


CHECK_THEN_WRITE_ONLY = Capabilities(put_if_absent=Guarantee.CHECK_THEN_WRITE,
                                     compare_and_swap=Guarantee.CHECK_THEN_WRITE)
LOCAL_FILES = Capabilities(put_if_absent=Guarantee.ATOMIC, compare_and_swap=Guarantee.ATOMIC)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class S3ProbeOutcome:
    """What the probe of an S3 store saw, each a yes/no answer of the store."""

    second_create_refused: bool  # a PUT with If-None-Match: * over an existing key was refused
    wrong_etag_refused: bool  # a PUT with If-Match naming another ETag was refused
    quoted_etag_accepted: bool  # a PUT with If-Match naming the key's ETag, quoted, was accepted
    bare_etag_accepted: bool  # the same with the quotes taken off


def s3_capabilities(seen: S3ProbeOutcome) -> Capabilities:
    """The capabilities an S3 probe shows. If-Match counts only if a wrong ETag is refused
    (a store that ignores the header accepts every form)."""
    create = Guarantee.ATOMIC if seen.second_create_refused else Guarantee.CHECK_THEN_WRITE
    form = None
    if seen.wrong_etag_refused:
        form = EtagForm.QUOTED if seen.quoted_etag_accepted else EtagForm.BARE if seen.bare_etag_accepted else None
    # a compare-and-swap of a missing key is a create: both headers must work
    swap = Guarantee.ATOMIC if form is not None and create is Guarantee.ATOMIC else Guarantee.CHECK_THEN_WRITE
    return Capabilities(put_if_absent=create, compare_and_swap=swap, etag_form=form)


def etag_for_if_match(etag: str, form: EtagForm) -> str:
    """``etag`` (as the store handed it out) in the form ``If-Match`` must carry."""
    bare = etag.strip().strip('"')
    return f'"{bare}"' if form is EtagForm.QUOTED else bare


class FenceStep(enum.Enum):
    """What ``advance_fence`` does after reading the stored attempt."""

    WRITE = "write"  # the stored attempt is lower (or there is none): write ours
    UNCHANGED = "unchanged"  # ours is already stored: nothing to write (a retry of our own advance)
    REFUSE = "refuse"  # a newer attempt is stored: ours is stale


def fence_step(stored: int | None, attempt: int) -> FenceStep:
    """The step for ``attempt`` when the fence holds ``stored`` (None: no fence yet)."""
    if stored is None or stored < attempt:
        return FenceStep.WRITE
    return FenceStep.UNCHANGED if stored == attempt else FenceStep.REFUSE


def parse_attempt(text: bytes | None) -> int | None:
    """The attempt a fence object holds (decimal text); None for no object or one that holds no number."""
    if text is None:
        return None
    value = text.decode(errors="replace").strip()
    return int(value) if value.isdigit() else None
