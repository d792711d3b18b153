"""What verification found: one Check per kind of check, and the report they make up."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class Check:
    name: str  # structure, recompute, behaviour, perplexity
    status: str  # pass, fail, warn (a difference the user chose), skip
    summary: str
    details: list[str] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)


@dataclass
class VerifyReport:
    out: Path
    checks: list[Check] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(c.status != "fail" for c in self.checks) and any(c.status == "pass" for c in self.checks)

    @property
    def summary(self) -> str:
        failed = [c.name for c in self.checks if c.status == "fail"]
        if failed:
            return f"failed: {', '.join(failed)}"
        done = [c.name for c in self.checks if c.status == "pass"]
        skipped = [c.name for c in self.checks if c.status == "skip"]
        if skipped:
            return f"passed: {', '.join(done)}; not fully verified ({', '.join(skipped)} skipped)"
        return f"passed: {', '.join(done)}"

    def to_dict(self) -> dict:
        return {
            "passed": self.passed,
            "summary": self.summary,
            "seconds": round(self.seconds, 3),
            "checks": [asdict(c) for c in self.checks],
        }
