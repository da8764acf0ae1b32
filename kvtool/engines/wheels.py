"""Fetch engines' wheels without dependencies and extract single files from them, cached between runs.

An engine's reference functions and Triton kernels are oracles for kvtool's tests and implementations for
`--impl` / `--peer`; they are read from the engine's own published wheel, never copied into this project. The wheel
is downloaded once with `pip download --no-deps` into `<cache>/engines/wheels/` (`<cache>` is `$KVTOOL_CACHE_DIR`,
else `~/.cache/kvtool`), and members are extracted on demand into `<cache>/engines/<dist>-<version>/`, a tree laid out
as site-packages would be. An installed distribution of the same version is used in place of the wheel.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvtool.errors import KvtoolError

__all__ = [
    "EnginePackage", "EngineUnavailable", "FLASHINFER", "PACKAGES", "SGLANG", "VLLM", "cache_root", "extract",
    "fetch_wheel", "find_wheel", "installed_root", "wheel_dir"
]


class EngineUnavailable(KvtoolError):
    """An engine package that is neither installed nor downloadable here (offline, or pip failed)."""


@dataclass(frozen=True)
class EnginePackage:
    """One pinned engine distribution: the PyPI name and the version kvtool's adapters and tests were written for."""

    dist: str
    version: str

    @property
    def hint(self) -> str:
        return f"pip download --no-deps {self.dist}=={self.version} -d {wheel_dir()}"


# The versions the recipes, adapters and the engines test tier were checked against.
VLLM = EnginePackage("vllm", "0.33.0")
SGLANG = EnginePackage("sglang", "0.5.23")
FLASHINFER = EnginePackage("flashinfer-python", "0.7.2.post1")
PACKAGES = {p.dist: p for p in (VLLM, SGLANG, FLASHINFER)}


def cache_root() -> Path:
    """`$KVTOOL_CACHE_DIR/engines`, else `~/.cache/kvtool/engines`."""
    root = os.environ.get("KVTOOL_CACHE_DIR") or Path.home() / ".cache" / "kvtool"
    return Path(root) / "engines"


def wheel_dir() -> Path:
    return cache_root() / "wheels"


def _normalized(dist: str) -> str:
    return dist.replace("-", "_").lower()


def find_wheel(pkg: EnginePackage) -> Path | None:
    """The cached wheel of `pkg`, or None."""
    d = wheel_dir()
    if not d.is_dir():
        return None
    prefix = f"{_normalized(pkg.dist)}-{pkg.version}-"
    hits = sorted(p for p in d.iterdir() if p.name.lower().startswith(prefix) and p.suffix == ".whl")
    return hits[0] if hits else None


def fetch_wheel(pkg: EnginePackage, *, download: bool = True) -> Path:
    """The path of `pkg`'s wheel, downloading it (no dependencies) when it is not cached yet.

    Raises `EngineUnavailable` with the command to run by hand when the download fails or `download` is False.
    """
    hit = find_wheel(pkg)
    if hit is not None:
        return hit
    if not download or os.environ.get("KVTOOL_OFFLINE"):
        raise EngineUnavailable(f"{pkg.dist}=={pkg.version} is not cached; fetch it with: {pkg.hint}")
    wheel_dir().mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", f"{pkg.dist}=={pkg.version}", "-d", str(wheel_dir())]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EngineUnavailable(f"could not download {pkg.dist}=={pkg.version} ({exc}); run: {pkg.hint}") from None
    hit = find_wheel(pkg)
    if proc.returncode != 0 or hit is None:
        last = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise EngineUnavailable(f"could not download {pkg.dist}=={pkg.version} ({last}); run: {pkg.hint}")
    return hit


def installed_root(pkg: EnginePackage) -> Path | None:
    """The site-packages folder of an installed distribution of exactly `pkg.version`, or None."""
    try:
        dist = importlib.metadata.distribution(pkg.dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != pkg.version:
        return None
    return Path(dist.locate_file(""))


def extract(pkg: EnginePackage, patterns: list[str] | tuple[str, ...], *, download: bool = True) -> Path:
    """A folder laid out as site-packages that holds every wheel member matching one of `patterns` (fnmatch).

    Prefers an installed distribution of the pinned version; otherwise extracts from the cached (or downloaded) wheel
    into `<cache>/engines/<dist>-<version>/`, once per member. Returns the folder; raises `EngineUnavailable` when the
    package cannot be had, or when no member matches a pattern (a renamed file in another version).
    """
    root = installed_root(pkg)
    if root is not None and all(any(root.glob(p)) for p in patterns):
        return root
    out = cache_root() / f"{_normalized(pkg.dist)}-{pkg.version}"
    wanted_missing = [p for p in patterns if not any(out.glob(p))]
    if not wanted_missing:
        return out
    wheel = fetch_wheel(pkg, download=download)
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        for pat in wanted_missing:
            hits = [n for n in names if fnmatch.fnmatch(n, pat)]
            if not hits:
                raise EngineUnavailable(f"{wheel.name} has no member matching {pat!r}")
            for name in hits:
                target = out / name
                if target.exists():
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
                tmp.write_bytes(zf.read(name))
                os.replace(tmp, target)
    return out


def prefetch() -> int:
    """Download every pinned engine wheel that is not cached yet (`python -m kvtool.engines.wheels`), one process at
    a time, so that parallel test workers only ever extract. Unavailable engines are reported, not fatal: their
    tests skip with the reason."""
    for pkg in PACKAGES.values():
        try:
            print(f"{pkg.dist}=={pkg.version}: {fetch_wheel(pkg)}")
        except EngineUnavailable as exc:
            print(f"{pkg.dist}=={pkg.version}: unavailable ({exc})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(prefetch())
