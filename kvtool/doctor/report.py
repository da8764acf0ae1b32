"""What `kvtool doctor` says: findings (one per suspected failure) and the report that holds them."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CandidateFit", "DoctorReport", "Finding", "SEVERITIES"]

SEVERITIES = ("error", "warning", "info")


@dataclass
class Finding:
    """One diagnosis. `code`: the failure class (e.g. `fp8-fnuz-as-fn`); `severity`: error | warning | info; where it
    is (`tensor`, `layer` parsed from `layers.{i}.` in the name, `head` or None for the whole tensor); `evidence`:
    the numbers behind it (counts, first offsets, the statistic and the value the format's own rule gives);
    `fix`: the likely fix, one line; `message`: what was seen, one line."""

    code: str
    severity: str
    tensor: str
    message: str
    fix: str
    layer: int | None = None
    head: int | None = None
    evidence: dict = field(default_factory=dict)


@dataclass
class CandidateFit:
    """One ranked reading of the input (a geometry, a format, or a transformation of a reference): lower `score` is
    more plausible (0: nothing implausible seen); `detail` names the statistics behind the score."""

    what: str
    score: float
    detail: dict = field(default_factory=dict)


@dataclass
class DoctorReport:
    """Everything `examine` found in one input. `findings` sorted by severity, then tensor; `tensors` the tensors
    examined; `candidates` ({topic: [CandidateFit, best first]}) the rankings behind geometry / format findings."""

    path: str
    kind: str
    tensors: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    candidates: dict = field(default_factory=dict)
    reference: str | None = None

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    @property
    def ok(self) -> bool:
        """True when no finding is an error (the CLI's exit 0)."""
        return not self.errors

    def codes(self, severity: str | None = None) -> set[str]:
        return {f.code for f in self.findings if severity is None or f.severity == severity}

    def sort(self) -> None:
        self.findings.sort(key=lambda f: (SEVERITIES.index(f.severity), f.tensor, f.code,
                                          -1 if f.head is None else f.head))
