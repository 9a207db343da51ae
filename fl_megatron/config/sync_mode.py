"""The sync mode: how the groups average, as one immutable value (what --fl-tune chooses between
and the engine owns; a switch replaces it whole)."""

from dataclasses import dataclass, field, fields
from typing import Optional

PRECISIONS = ("fp32", "bf16", "int8", "int4")  # most exact first (the dense syncs')
COMPRESSED = ("int8", "int4")
VALUE_CODES = (*PRECISIONS, "int2")  # every sync_dtype, as a number (int2: the sparse sync's only)


def sparse_codec_name(sync_dtype: str, topk_density: float) -> str:
    """The sparse sync's codec as the probe and the tuner name it: "int2 top 0.0156"."""
    return f"{sync_dtype} top {topk_density:g}"


@dataclass(frozen=True)
class SyncMode:
    """What `--fl-sync-dtype`, `--fl-overlap-steps`, `--fl-fragments`, `--fl-sync-interval`,
    `--fl-error-feedback` and `--fl-topk-density` say. `error_feedback` left out: on for int8/int4
    and every sparse sync, off otherwise (what --fl-tune picks)."""

    sync_dtype: str
    overlap_steps: int
    fragments: int
    sync_interval: int
    error_feedback: Optional[bool] = field(default=None)
    topk_density: float = 0.0  # the sparse sync's share of each chunk sent (0: dense)

    def __post_init__(self) -> None:
        if self.error_feedback is None:
            object.__setattr__(self, "error_feedback", self.sync_dtype in COMPRESSED or bool(self.topk_density))

    @property
    def sync_every(self) -> int:
        """Steps between two syncs: H, or H/N with fragments."""
        return self.sync_interval // self.fragments

    def label(self) -> str:
        sparse = f" top {self.topk_density:.3g}" if self.topk_density else ""
        parts = [self.sync_dtype + sparse + (" + EF" if self.error_feedback else ""), f"H {self.sync_interval}"]
        if self.overlap_steps:
            parts.append(f"overlap {self.overlap_steps}")
        if self.fragments > 1:
            parts.append(f"{self.fragments} fragments")
        return ", ".join(parts)

    def fields(self) -> dict:
        """The FederationConfig fields this mode sets."""
        return {"sync_dtype": self.sync_dtype, "error_feedback": self.error_feedback,
                "overlap_steps": self.overlap_steps, "fragments": self.fragments,
                "sync_interval": self.sync_interval, "topk_density": self.topk_density}

    def flags(self) -> list[str]:
        """The pretrain flags that pin this mode by hand (a run without --fl-tune)."""
        return ["--fl-sync-dtype", self.sync_dtype, *(["--fl-error-feedback"] if self.error_feedback else []),
                "--fl-overlap-steps", str(self.overlap_steps), "--fl-fragments", str(self.fragments),
                "--fl-sync-interval", str(self.sync_interval),
                *(["--fl-topk-density", f"{self.topk_density:g}"] if self.topk_density else [])]

    def caution(self) -> tuple:
        """Sort key: smaller is closer to an exact fp32 average at the given H."""
        return (self.sync_interval, self.precision_rank, self.overlap_steps, self.fragments)

    @property
    def codec(self) -> str:
        """The codec's name, as the link probe times it: the sync dtype, or the sparse sync's."""
        return sparse_codec_name(self.sync_dtype, self.topk_density) if self.topk_density else self.sync_dtype

    @property
    def precision_rank(self) -> float:
        """How far from exact the values travel: a dense sync's place in PRECISIONS, a sparse one
        past every dense one (the sparser, the further), then by its values' precision."""
        if not self.topk_density:
            return float(PRECISIONS.index(self.sync_dtype))
        return len(PRECISIONS) + (1 - self.topk_density) + VALUE_CODES.index(self.sync_dtype) / 100

    @classmethod
    def from_fields(cls, saved: dict) -> "SyncMode":
        """The mode a dict of its fields names (a checkpoint's); unnamed fields take a plain sync's."""
        names = {f.name for f in fields(cls)}
        given = {k: v for k, v in saved.items() if k in names}
        return cls(**{"sync_dtype": "fp32", "overlap_steps": 0, "fragments": 1, "sync_interval": 1, **given})
