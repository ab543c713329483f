"""`StateFile`: one simulated GPU's device file, parsed again only when another write changed it.

Every NVML-like getter of `SimGPU` needs the device's state. Reading the file each time (open,
lock, read, close, parse the JSON) cost an agent with 8 GPUs sampled at 10 Hz several percent
of a core: the simulator's own work, which a real GPU's microsecond getters do not charge.

So each write also bumps a generation number, 8 bytes at the start of the device's lock file
(``gpu{index}.lock``, otherwise only locked), which every handle maps into memory. A read
compares the mapped generation with the one of the state it parsed last: equal, it answers
from that copy without a system call; different (or nothing parsed yet), it reads the file
under the shared lock, with the generation read under the same lock.

Why this stays coherent across processes (the agent's setters, a trainer's `run_work`): a
writer holds the exclusive lock while it rewrites the file and bumps the generation, so a
(generation, state) pair read under the shared lock always belongs together, and a reader that
sees the generation unchanged sees the state as of that instant. A write that finished before a
read began (in any process) is visible to it: the writer's unlock and whatever told the reader
about the write (a socket, a lock) order the mapped store before the reader's load, and a
changed generation sends the reader to the file under the lock. Unlike a file's mtime, which
the kernel may keep for milliseconds, the generation changes at every write.

Only `StateFile.write` may change a device file; one edited by hand is seen by handles opened
after the edit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import mmap
import os
import struct
from collections.abc import Iterator
from pathlib import Path

from zeus_agent.errors import GPUUnavailableError
from zeus_agent.gpu.sim.physics import HardwareParams
from zeus_agent.gpu.sim.state import DeviceState

__all__ = ["StateFile"]

_GEN = struct.Struct("<Q")
"""The generation: an unsigned 64-bit count at offset 0 of the lock file."""


class StateFile:
    """The device file of one simulated GPU and its lock, with the parsed state kept.

    Attributes:
        path: The device file (``gpu{index}.json``).
        lock_path: Its lock file, which also holds the generation (``gpu{index}.lock``).
    """

    def __init__(self, state_dir: Path, index: int) -> None:
        """Name the files of GPU `index` in `state_dir` (the directory must exist to read)."""
        self.index = index
        self.path = state_dir / f"gpu{index}.json"
        self.lock_path = state_dir / f"gpu{index}.lock"
        self._gen: _Mapping | None = None
        self._cache: tuple[_Mapping, int, DeviceState] | None = None
        """(mapping, generation, state parsed at it); replaced whole, so threads see consistent
        triples (a generation of a lock file created anew is not one of the deleted file's)."""

    def _mapped(self) -> _Mapping:
        """The lock file's mapping, made again when that file was deleted (created anew).

        One `fstat` per call: a handle that kept mapping a deleted lock file (the state
        directory wiped and the devices created again, e.g. by a restarted agent) would never
        see another write, nor anyone its own.
        """
        mapped = self._gen
        if mapped is not None and os.fstat(mapped.fd).st_nlink > 0:
            return mapped
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size < _GEN.size:
                fcntl.flock(fd, fcntl.LOCK_EX)  # grow it once, not under a reader's feet
                try:
                    if os.fstat(fd).st_size < _GEN.size:
                        os.ftruncate(fd, _GEN.size)
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
            mapped = _Mapping(fd, mmap.mmap(fd, _GEN.size, mmap.MAP_SHARED))
        except BaseException:
            os.close(fd)
            raise
        self._gen = mapped  # (the one replaced is closed when no thread uses it any more)
        return mapped

    def _generation_map(self) -> mmap.mmap:
        """The mapped generation, the lock file grown to hold it first if it was empty."""
        return self._mapped().map

    def _generation(self) -> tuple[_Mapping, int]:
        mapped = self._mapped()
        return mapped, int(_GEN.unpack_from(mapped.map, 0)[0])

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the exclusive lock of the device file (every writer does)."""
        self._generation_map()  # (it may lock to grow the file: not while this lock is held)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def read(self, hardware: HardwareParams | None, lock: bool = True) -> DeviceState:
        """The device's state; the caller must not change it (`update` gives a copy).

        Answered from the state parsed last when no write happened since; otherwise the file is
        read under the shared lock, unless `lock` is False (the caller holds the exclusive one).

        Raises:
            GPUUnavailableError: The file is missing or unreadable.
        """
        try:
            mapped, gen = self._generation()
            cached = self._cache
            if cached is not None and cached[0] is mapped and cached[1] == gen:
                return cached[2]
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644) if lock else -1
            try:
                if lock:
                    fcntl.flock(fd, fcntl.LOCK_SH)
                    mapped, gen = self._generation()  # stable while the lock is held
                with open(self.path, "rb") as fh:
                    raw = fh.read()
            finally:
                if lock:
                    os.close(fd)  # closing releases the lock
            data = json.loads(raw)
        except (OSError, ValueError) as exc:
            raise GPUUnavailableError(
                f"simulated GPU {self.index}: cannot read {self.path} ({exc}); create it with "
                f"SimGPU.create"
            ) from exc
        state = DeviceState.from_json(data, hardware)
        self._cache = (mapped, gen, state)
        return state

    def write(self, state: DeviceState) -> None:
        """Rewrite the device file in place and bump the generation; hold `locked()`.

        In place rather than write-and-rename: a rename costs hundreds of microseconds on some
        file systems, and a schedule locks clocks at every instruction.
        """
        data = json.dumps(state.to_json()).encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
        finally:
            os.close(fd)
        mapped, gen = self._generation()
        gen += 1
        _GEN.pack_into(mapped.map, 0, gen)
        self._cache = (mapped, gen, dataclasses.replace(state))  # the caller's copy may change on

    @contextlib.contextmanager
    def update(self, hardware: HardwareParams | None) -> Iterator[DeviceState]:
        """Lock, yield a copy of the state to change, write it back (unless the body raised)."""
        with self.locked():
            state = dataclasses.replace(self.read(hardware, lock=False))
            yield state
            self.write(state)


class _Mapping:
    """The lock file's generation mapped, and the descriptor that tells whether it was deleted."""

    __slots__ = ("fd", "map")

    def __init__(self, fd: int, mapped: mmap.mmap) -> None:
        self.fd = fd
        self.map = mapped

    def __del__(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            os.close(self.fd)
