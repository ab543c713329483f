"""`RaplReader`: CPU package and DRAM energy counters (RAPL), read from the powercap sysfs tree.

What it reads (Linux's powercap interface of the RAPL driver), under `--rapl-root`
(default `/sys/class/powercap`; `/sys/class/powercap/intel-rapl` works too):

    intel-rapl:<p>/name                          package-<p>   (a CPU package: Zeus's CPU <p>)
    intel-rapl:<p>/energy_uj                     its counter (µJ)
    intel-rapl:<p>/max_energy_range_uj           where that counter wraps
    intel-rapl:<p>/intel-rapl:<p>:<d>/name       dram          (the package's DRAM domain)
    intel-rapl:<p>/intel-rapl:<p>:<d>/energy_uj  ... and its counter, max_energy_range_uj

AMD Zen CPUs appear under the same names where the kernel's RAPL driver supports them
(Linux 5.8 and later): a package domain, no DRAM domain, so their DRAM energy is None. Zones
not named `package-*` (a laptop's `psys`) are not CPUs and are skipped; `intel-rapl-mmio`
duplicates a package's counter and is skipped too.

The counters wrap at `max_energy_range_uj` (262 kJ on most servers: about 20 minutes at
200 W; a few platforms wrap at 2^32 µJ, 4.3 kJ, about 20 s). The agent reads every counter
every `--rapl-period-s` (default 0.1 s) into a ring (`zeus_agent.agent.core.rapl`), which
catches every wrap below `max_energy_range_uj / period` (43 kW at 4.3 kJ and 0.1 s), and
answers a window from those readings: between two readings by interpolation, and past the
newest one with a reading made when the window is answered (kept out of the ring). Each
reading is one small sysfs read per counter (microseconds), on the agent's event loop.

Unreadable counters: `energy_uj` is readable by root only on current kernels (since the
PLATYPUS fix), which is why Zeus needs its privileged daemon; the agent usually runs as root.
When no package can be read (no tree, a VM, no permission), the agent says so once in its log
and answers every window's CPU and DRAM energy as missing; a trainer's `ZeusMonitor` then
returns `cpu_energy=None` and `dram_energy=None`, as Zeus does on such a node. A DRAM domain
that cannot be read leaves that package's DRAM energy None. A reading that fails later is
counted (`read_errors`, in the metrics) and logged on the first failure and every 1000th.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from zeus_agent.agent.core.rapl import (
    CpuWindow,
    PackageReading,
    RaplPackage,
    answer_window,
    max_safe_power_w,
)
from zeus_agent.wire.text import bounded
from zeus_agent.wire.trainer import WindowRequest

LOG = logging.getLogger(__name__)

DEFAULT_RAPL_ROOT = "/sys/class/powercap"
DEFAULT_RAPL_PERIOD_S = 0.1
"""How often every RAPL counter is read (s): far below a wrap period, fine enough that a
window's start (interpolated between two readings) is within 50 ms of its stamp."""
MAX_CPU_ERROR_CHARS = 1000
"""Longest `cpu_error` in a window reply (a reply is one datagram)."""
DISABLED = frozenset({"", "none"})
"""`--rapl-root` values that turn RAPL reading off."""

_ZONE = re.compile(r"^intel-rapl:(\d+)$")
_SUBZONE = re.compile(r"^intel-rapl:(\d+):(\d+)$")
PERMISSION_HELP = (
    "RAPL's energy_uj is readable by root only on current kernels: run the agent as root, or "
    "make the energy_uj files readable by its user (e.g. a udev rule or systemd-tmpfiles)"
)


def read_uj(path: str) -> int:
    """One counter file's value (an integer; µJ for energy files).

    Raises:
        OSError: The file cannot be read.
        ValueError: It does not hold an integer.
    """
    with open(path, "rb", buffering=0) as f:
        return int(f.read(64))


def _read_name(path: str) -> str:
    with open(os.path.join(path, "name"), "rb", buffering=0) as f:
        return f.read(64).decode("ascii", "replace").strip()


@dataclass(frozen=True)
class PackageFiles:
    """Where one package's counters are, and where they wrap.

    Attributes:
        index: The package's index (`intel-rapl:<index>`, Zeus's CPU index).
        energy: Its `energy_uj` file.
        max_range_uj: Its `max_energy_range_uj`.
        dram_energy: The DRAM domain's `energy_uj`, or None without a readable one.
        dram_max_range_uj: The DRAM domain's `max_energy_range_uj` (None without one).
    """

    index: int
    energy: str
    max_range_uj: int
    dram_energy: str | None = None
    dram_max_range_uj: int | None = None


def _first_reading(path: str) -> tuple[int | None, str]:
    """`(max_energy_range_uj, "")` of a domain whose counter reads, else `(None, why)`."""
    try:
        read_uj(os.path.join(path, "energy_uj"))
        max_range = read_uj(os.path.join(path, "max_energy_range_uj"))
    except PermissionError:
        return None, f"{path}: permission denied"
    except (OSError, ValueError) as e:
        return None, f"{path}: {getattr(e, 'strerror', None) or e}"
    if max_range <= 0:
        return None, f"{path}: max_energy_range_uj is {max_range}"
    return max_range, ""


def _dram_of(zone: str, index: int) -> tuple[str | None, int | None, str]:
    """The DRAM domain of package `index` in `zone`: (energy file, max range, problem)."""
    try:
        entries = sorted(os.listdir(zone))
    except OSError as e:
        return None, None, f"{zone}: {e.strerror or e}"
    for entry in entries:
        match = _SUBZONE.match(entry)
        if match is None or int(match.group(1)) != index:
            continue
        path = os.path.join(zone, entry)
        try:
            if _read_name(path) != "dram":
                continue
        except OSError:
            continue
        max_range, why = _first_reading(path)
        if max_range is None:
            return None, None, f"DRAM of CPU {index}: {why}"
        return os.path.join(path, "energy_uj"), max_range, ""
    return None, None, ""


def find_packages(root: str) -> tuple[list[PackageFiles], list[str]]:
    """The packages under `root` whose counters read, and what is wrong with the others.

    Returns:
        `(packages, problems)`: packages in index order (with their DRAM domain where it
        reads); one line per zone or DRAM domain that is there but cannot be read.
    """
    try:
        entries = os.listdir(root)
    except OSError:
        return [], []
    packages: list[PackageFiles] = []
    problems: list[str] = []
    zones = sorted((int(m.group(1)), e) for e in entries if (m := _ZONE.match(e)))
    for index, entry in zones:
        zone = os.path.join(root, entry)
        try:
            name = _read_name(zone)
        except OSError as e:
            problems.append(f"{zone}/name: {e.strerror or e}")
            continue
        if not name.startswith("package"):
            continue  # psys: the platform's energy, not a CPU's
        max_range, why = _first_reading(zone)
        if max_range is None:
            problems.append(why)
            continue
        dram, dram_range, dram_problem = _dram_of(zone, index)
        if dram_problem:
            problems.append(dram_problem)
        packages.append(PackageFiles(index, os.path.join(zone, "energy_uj"), max_range,
                                     dram, dram_range))
    return packages, problems


class RaplReader:
    """The node's RAPL counters: `open()` once, `poll()` every `period_s`, `window()` to answer.

    Attributes:
        root: The powercap tree read.
        period_s: How often `poll` is meant to run (s).
        packages: The packages read, by index (empty when none can be).
        why_none: Why no package is read ("" when some are, or before `open`).
        read_errors: Failed readings by `(index, "package" | "dram")`.
        reads: Readings made (each reads every counter of one package).
    """

    def __init__(
        self,
        root: str = DEFAULT_RAPL_ROOT,
        period_s: float = DEFAULT_RAPL_PERIOD_S,
        ring_seconds: float = 600.0,
    ) -> None:
        if not period_s > 0:
            raise ValueError(f"period_s must be positive, got {period_s!r}")
        self.root = root
        self.period_s = period_s
        self.ring_seconds = ring_seconds
        self.packages: dict[int, RaplPackage] = {}
        self.files: dict[int, PackageFiles] = {}
        self.why_none = ""
        self.read_errors: Counter[tuple[int, str]] = Counter()
        self.reads = 0
        self._fresh: dict[int, PackageReading] = {}

    @property
    def available(self) -> bool:
        """Whether any package's counters are read."""
        return bool(self.packages)

    def open(self) -> bool:
        """Find the packages, take their first readings, and say once what is measured.

        Returns:
            Whether any package can be read.
        """
        if self.root.strip().lower() in DISABLED:
            self.why_none = "RAPL reading is turned off (--rapl-root none)"
            LOG.info("%s: CPU and DRAM energy are not measured", self.why_none)
            return False
        files, problems = find_packages(self.root)
        for problem in problems:
            if "permission denied" in problem:
                LOG.warning("RAPL counter not readable: %s. %s", problem, PERMISSION_HELP)
            else:
                LOG.warning("RAPL counter not readable: %s", problem)
        if not files:
            if problems:
                self.why_none = (f"no RAPL counter under {self.root} can be read ("
                                 f"{'; '.join(problems)})")
                if any("permission denied" in p for p in problems):
                    self.why_none += f": {PERMISSION_HELP}"
            else:
                self.why_none = (f"no RAPL counters on this node (nothing named intel-rapl:<n> "
                                 f"under {self.root}: no RAPL powercap driver, or a VM)")
            LOG.info("%s; CPU and DRAM energy are not measured (windows answer None)",
                     self.why_none)
            return False
        capacity = max(16, int(self.ring_seconds / self.period_s) + 16)
        horizon = max(1_000_000_000, int(2e9 * self.period_s))
        for f in files:
            self.files[f.index] = f
            self.packages[f.index] = RaplPackage(f.index, f.max_range_uj, f.dram_max_range_uj,
                                                 capacity, horizon)
        self.poll()
        smallest = min(min(f.max_range_uj, f.dram_max_range_uj or f.max_range_uj)
                       for f in files)
        LOG.info(
            "RAPL: CPU packages %s (DRAM: %s) under %s, read every %g s (a counter wraps "
            "unseen only above %.0f W)",
            sorted(self.packages),
            sorted(f.index for f in files if f.dram_energy is not None) or "none",
            self.root, self.period_s, max_safe_power_w(smallest, self.period_s),
        )
        return True

    def _read(self, f: PackageFiles) -> PackageReading:
        """Read one package's counters now (a failed read is None, counted and logged)."""
        start = time.monotonic_ns()
        cpu = self._read_one(f.energy, f.index, "package")
        dram = None if f.dram_energy is None else self._read_one(f.dram_energy, f.index, "dram")
        self.reads += 1
        return PackageReading((start + time.monotonic_ns()) // 2, cpu, dram)

    def _read_one(self, path: str, index: int, domain: str) -> int | None:
        try:
            return read_uj(path)
        except (OSError, ValueError) as e:
            key = (index, domain)
            self.read_errors[key] += 1
            n = self.read_errors[key]
            if n == 1 or n % 1000 == 0:
                LOG.warning("RAPL: reading %s failed (%d so far): %s", path, n,
                            getattr(e, "strerror", None) or e)
            return None

    def poll(self) -> None:
        """Read every package's counters into its rings."""
        for index, f in self.files.items():
            self.packages[index].record(self._read(f))

    def window(self, t0_ns: int, t1_ns: int, wanted: Sequence[int] | None) -> CpuWindow:
        """The CPU and DRAM energy between two stamps of the packages asked for (None: all).

        A window ending after the newest reading kept is answered with a reading made now
        (one per window at most; kept out of the rings).
        """
        if not self.packages:
            return CpuWindow(problem=self.why_none or "RAPL counters are not read")
        indices = sorted(self.packages) if wanted is None else [
            i for i in dict.fromkeys(wanted) if i in self.packages]
        fresh: dict[int, PackageReading] = {}
        for index in indices:
            latest = self.packages[index].cpu.ring.latest()
            if latest is not None and latest[0] >= t1_ns:
                continue  # a kept reading brackets the end
            cached = self._fresh.get(index)
            if cached is None or cached.t_ns < t1_ns:
                cached = self._fresh[index] = self._read(self.files[index])
            fresh[index] = cached
        return answer_window(self.packages, wanted, t0_ns, t1_ns, fresh)


def cpu_reply(rapl: RaplReader | None, window: WindowRequest) -> dict[str, Any]:
    """The fields a WINDOW reply adds for the CPU energy it asks for (none when it asks none).

    `cpus`, `cpu_energy_j`, `dram_energy_j` (see `WindowRequest.cpus`), and `cpu_error` when a
    package asked for is missing.
    """
    if window.cpus is None:
        return {}
    wanted = None if window.cpus == "all" else window.cpus
    if rapl is None:
        answer = CpuWindow(problem="this agent reads no RAPL counters")
    else:
        answer = rapl.window(window.t0_ns, window.t1_ns, wanted)
    fields: dict[str, Any] = {
        "cpus": list(answer.cpus),
        "cpu_energy_j": list(answer.cpu_j),
        "dram_energy_j": list(answer.dram_j),
    }
    if answer.problem:
        fields["cpu_error"] = bounded(answer.problem, MAX_CPU_ERROR_CHARS)
    return fields
