"""Transfer counters of one worker, reported as flat increments ("p2p.<name>")."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class TransferStats:
    """Since the last `take()`: transfers, bytes and seconds, failures, expired holds."""

    transfers: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failures: int = 0
    expired: int = 0

    def take(self, side: str) -> dict[str, float]:
        """Increments as `"p2p.{side}_{counter}"` (side: "send" or "recv"); resets to zero."""
        out = {f"p2p.{side}_{f.name}": float(getattr(self, f.name)) for f in fields(self)}
        for f in fields(self):
            setattr(self, f.name, type(getattr(self, f.name))())
        return {k: v for k, v in out.items() if v}
