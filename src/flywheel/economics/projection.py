"""Projection: what a measured run would cost on another catalog entry. An ESTIMATE.

FLOPs per token for a dense transformer of P parameters (the usual approximation, which
ignores attention's sequence-length term and counts a multiply-add as 2 FLOPs):

    forward (sampling, serving, eval)   2 P FLOPs per token   -> tokens_generated, tokens_served
    training (forward + backward)       6 P FLOPs per token   -> tokens_trained

    device-seconds on target = FLOPs / (peak FLOP/s x MFU)
    estimated USD            = device-seconds x usd_per_hour / 3600

MFU (model FLOPs utilisation) is assumed, not measured on the target: 0.4 by default, a
typical figure for well-tuned large-batch GPU training. Small-batch decoding is
memory-bandwidth bound and usually far below it, so generation-heavy runs are
underestimated at one MFU; pass a lower one for them. Prompt (prefill) tokens are not in
the ledger's token counts, so their FLOPs are not counted either. Records without a parameter
count (record.params, else the `params` argument) or without tokens (curation, say) cannot be
projected: they are counted apart, with their measured cost, and left out of the comparison.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from flywheel.economics.catalog import Catalog, Hardware
from flywheel.economics.ledger import CostRecord
from flywheel.economics.reports import family_of, per_million, token_field

LABEL = "estimate"
FORWARD_FLOPS_PER_PARAM = 2  # per token
TRAIN_FLOPS_PER_PARAM = 6  # per token: forward 2 + backward 4
DEFAULT_MFU = 0.4


def flops_per_token(params: int, *, train: bool) -> float:
    return (TRAIN_FLOPS_PER_PARAM if train else FORWARD_FLOPS_PER_PARAM) * params


def record_flops(r: CostRecord, params: int | None = None) -> float | None:
    """Model FLOPs of one record, or None without a parameter count."""
    p = r.params or params
    if p is None:
        return None
    return (flops_per_token(p, train=False) * (r.tokens_generated + r.tokens_served)
            + flops_per_token(p, train=True) * r.tokens_trained)


def estimate_seconds(flops: float, hw: Hardware, mfu: float) -> float:
    """Device-seconds to do `flops` on `hw` at utilisation `mfu`."""
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    return flops / (hw.peak_flops * mfu)


def estimate_usd(flops: float, hw: Hardware, mfu: float) -> float:
    return estimate_seconds(flops, hw, mfu) * hw.usd_per_hour / 3600.0


@dataclass(frozen=True)
class FamilyEstimate:
    family: str
    tokens: int
    flops: float
    measured_usd: float
    estimated_usd: float
    estimated_device_hours: float

    @property
    def estimated_usd_per_million(self) -> float | None:
        return per_million(self.estimated_usd, self.tokens)


@dataclass(frozen=True)
class Projection:
    """A measured run priced on `target`. Every figure here is an estimate."""

    target: Hardware
    mfu: float
    flops: float
    measured_usd: float  # what the projected records actually cost
    estimated_usd: float
    estimated_device_hours: float
    families: tuple[FamilyEstimate, ...]
    unprojected_records: int  # records without a parameter count or without tokens
    unprojected_usd: float  # their measured cost, left out of measured_usd
    label: str = LABEL

    @property
    def ratio(self) -> float | None:
        """estimated / measured cost (< 1: the target would be cheaper)."""
        return self.estimated_usd / self.measured_usd if self.measured_usd > 0 else None


def project(records: Iterable[CostRecord], target: Hardware, *, mfu: float = DEFAULT_MFU,
            params: int | None = None) -> Projection:
    acc: dict[str, list[float]] = {}
    flops_total = measured = 0.0
    skipped, skipped_usd = 0, 0.0
    for r in records:
        f = record_flops(r, params)
        if not f:  # no parameter count, or no tokens (curation, bookkeeping): nothing to scale
            skipped += 1
            skipped_usd += r.usd
            continue
        fam = family_of(r.stage)
        tf = token_field(fam)
        row = acc.setdefault(fam, [0, 0.0, 0.0])
        row[0] += getattr(r, tf) if tf else 0
        row[1] += f
        row[2] += r.usd
        flops_total += f
        measured += r.usd
    fams = tuple(FamilyEstimate(fam, int(tok), fl, usd, estimate_usd(fl, target, mfu),
                                estimate_seconds(fl, target, mfu) / 3600.0)
                 for fam, (tok, fl, usd) in acc.items())
    return Projection(target, mfu, flops_total, measured, estimate_usd(flops_total, target, mfu),
                      estimate_seconds(flops_total, target, mfu) / 3600.0, fams, skipped, skipped_usd)


def measured_mfu(records: Iterable[CostRecord], catalog: Catalog, *, params: int | None = None) -> float | None:
    """Model FLOPs actually achieved / peak FLOPs of the devices held, over the projectable
    records: a check on the assumed MFU (on a CPU it is usually far below a GPU's)."""
    done = possible = 0.0
    for r in records:
        f = record_flops(r, params)
        if f is None or r.hardware not in catalog:
            continue
        done += f
        possible += r.device_seconds * catalog.get(r.hardware).peak_flops
    return done / possible if possible > 0 else None


def project_many(records: Sequence[CostRecord], targets: Sequence[Hardware], *, mfu: float = DEFAULT_MFU,
                 params: int | None = None) -> list[Projection]:
    return [project(records, t, mfu=mfu, params=params) for t in targets]
