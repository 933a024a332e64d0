"""C kernels for the CPU path, built on first use with the machine's C compiler and called through ctypes.

Each source (`model/kernels/*.c`) is built with `cc` (or `$CC`) for this CPU (`-march=native`) into
`$MINEDRAFT_CACHE_DIR` (default `~/.cache/minedraft`), one file per source, flags, compiler and CPU, so later
processes load it in milliseconds. Their OpenMP threads are torch's own: the libraries link `libgomp.so.1`,
which the loader resolves to the copy torch already loaded. Where no compiler works, `KernelUnavailable` says
why, and the callers keep torch's ops (or refuse, where a user asked for the kernel by name).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
_BUILD_TIMEOUT_S = 300
_LOCAL_INCLUDE = re.compile(r'^#include "([^"]+)"', re.MULTILINE)  # a source or header beside it, built into it


class KernelUnavailable(RuntimeError):
    """The kernel could not be built or loaded here; the message says why."""


@functools.cache
def library(source_name: str, declare: Callable[[ctypes.CDLL], None]) -> ctypes.CDLL:
    """The built `model/kernels/<source_name>`, building it first if this machine has no copy yet; `declare` sets its
    functions' ctypes signatures."""
    source = Path(__file__).with_name(source_name)
    built = _cache_dir() / f"{source.stem}-{_build_key(source)}.so"
    if not built.exists():
        _build(source, built)
    try:
        lib = ctypes.CDLL(str(built))
    except OSError as exc:
        raise KernelUnavailable(f"could not load {built.name}: {exc}") from exc
    declare(lib)
    return lib


def unavailable(load: Callable[[], ctypes.CDLL]) -> str | None:
    """None when `load` loads its kernel here, else why not."""
    try:
        load()
    except KernelUnavailable as exc:
        return str(exc)
    return None


def _cache_dir() -> Path:
    root = os.environ.get("MINEDRAFT_CACHE_DIR") or Path.home() / ".cache" / "minedraft"
    return Path(root) / "kernels"


def remembered(name: str, measure: Callable[[], bool]) -> bool:
    """A verdict about this CPU that `measure` times (which of two kernels is faster), kept beside the built
    kernels so that only the first process on the machine pays for the timing. `name` holds what else decides it
    (the dtype, torch's version); the CPU is part of the key here."""
    cpu = hashlib.sha256(_cpu_signature().encode()).hexdigest()[:16]
    path = _cache_dir().parent / "verdicts" / f"{name}-{cpu}.json"
    try:
        return bool(json.loads(path.read_text())["verdict"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    verdict = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")  # processes may measure side by side
        partial.write_text(json.dumps({"verdict": verdict}))
        partial.replace(path)
    except OSError as exc:
        log.warning("could not keep a kernel choice in %s (%s): the next process times it again", path, exc)
    return verdict


def _compiler() -> str:
    cc = os.environ.get("CC", "cc")
    path = shutil.which(cc)
    if path is None:
        raise KernelUnavailable(f"no C compiler: {cc!r} is not on PATH (set CC, or install gcc)")
    return path


def _build_key(source: Path) -> str:
    """What the built file depends on: the source and the files it includes (theirs too), the flags, the compiler
    and the CPU (-march=native)."""
    digest = hashlib.sha256()
    for part in _sources(source):
        digest.update(part.read_bytes())
    digest.update(" ".join(_FLAGS).encode())
    try:
        version = subprocess.run([_compiler(), "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"the C compiler did not run: {exc}") from exc
    digest.update(version.encode())
    digest.update(_cpu_signature().encode())
    return digest.hexdigest()[:16]


def _sources(source: Path) -> list[Path]:
    """`source` and every local file it includes, directly or through another, each once, in include order."""
    found: list[Path] = []
    pending = [source]
    while pending:
        path = pending.pop()
        if path not in found:
            found.append(path)
            pending.extend(reversed([path.with_name(name) for name in _LOCAL_INCLUDE.findall(path.read_text())]))
    return found


def _cpu_signature() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(lines)))


def _build(source: Path, built: Path) -> None:
    built.parent.mkdir(parents=True, exist_ok=True)
    partial = built.with_name(f"{built.name}.{os.getpid()}.partial")  # processes may build side by side
    command = [_compiler(), *_FLAGS, str(source), "-o", str(partial), "-lm"]
    log.info("building a CPU kernel (once per machine): %s", " ".join(command))
    try:
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
    except subprocess.CalledProcessError as exc:
        raise KernelUnavailable(f"building {source.name} failed: {exc.stderr.strip()[-2000:]}") from exc
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"building {source.name} failed: {exc}") from exc
    os.replace(partial, built)
