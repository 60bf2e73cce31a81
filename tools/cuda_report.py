#!/usr/bin/env python3
"""What every CUDA kernel of a build costs the SM: registers, stack frame, static shared memory
(and whether it takes more at launch), the most threads per CTA its __launch_bounds__ allow,
and the resident warps per SM those leave; then each CUDA translation unit's compile time.
Reads the build's device objects with cuobjdump (-res-usage, -elf, -ptx) and its .ninja_log.
Python's standard library only.

  tools/cuda_report.py BUILD_DIR --cuobjdump PATH [--out FILE] [--source-dir DIR]

scripts/cuda-report finds or installs cuobjdump and runs this.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import re
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class SmLimits:
    """Per-SM limits of the occupancy calculator (CUDA C Programming Guide, compute capabilities)."""

    regs_per_smsp: int = 16384  # 64K registers in 4 partitions; a warp lives on one
    reg_unit: int = 256  # registers are allocated per warp in units of 256
    max_warps: int = 64
    max_ctas: int = 32
    shared_bytes: int = 0  # usable shared memory per SM
    shared_unit: int = 128  # shared memory is allocated per CTA in units of 128 bytes
    reserved_shared: int = 1024  # the driver's per CTA


# sm_90a binaries seem to count the reserved 1 KB in the static size already (most of our
# kernels report 1 KB more for sm_90a than for sm_80), so shared-bound figures there may be
# one CTA low; today shared memory binds no kernel.
LIMITS = {
    "sm_80": SmLimits(shared_bytes=164 * 1024),
    "sm_90a": SmLimits(shared_bytes=228 * 1024),
}


@dataclasses.dataclass
class Kernel:
    arch: str
    symbol: str
    regs: int
    stack: int
    shared: int
    local: int
    threads: int | None = None  # the launch bounds' most threads per CTA
    units: set[str] = dataclasses.field(default_factory=set)


def occupancy(k: Kernel) -> tuple[int, str]:
    """Resident warps per SM and what limits them (regs, threads, shared, ctas)."""
    lim = LIMITS.get(k.arch)
    if lim is None or not k.threads:
        return 0, "?"
    warps_per_cta = math.ceil(k.threads / 32)
    regs_per_warp = math.ceil(max(k.regs, 1) * 32 / lim.reg_unit) * lim.reg_unit
    by = {
        "regs": 4 * (lim.regs_per_smsp // regs_per_warp) // warps_per_cta,
        "threads": lim.max_warps // warps_per_cta,
        "ctas": lim.max_ctas,
    }
    if k.shared:
        per_cta = math.ceil((k.shared + lim.reserved_shared) / lim.shared_unit) * lim.shared_unit
        by["shared"] = lim.shared_bytes // per_cta
    ctas = min(by.values())
    limiter = min(by, key=lambda n: (by[n], n != "threads"))
    return ctas * warps_per_cta, limiter


def output_lines(cmd: list[str]) -> Iterator[str]:
    """cmd's stdout line by line (cuobjdump -elf of one instance file is tens of MB)."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
        yield from proc.stdout
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)


def parse_resources(res_usage: Iterable[str]) -> dict[tuple[str, str], Kernel]:
    """`cuobjdump -res-usage` output -> kernels by (arch, mangled symbol)."""
    arch, name, found = None, None, {}
    for line in res_usage:
        if m := re.match(r"arch = (\S+)", line):
            arch = m.group(1)
        elif m := re.match(r"\s*Function (\S+):$", line):
            name = m.group(1)
        elif name and (m := re.match(r"\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", line)):
            regs, stack, shared, local = map(int, m.groups())
            found[(arch, name)] = Kernel(arch, name, regs, stack, shared, local)
            name = None
    return found


def parse_max_threads(elf: Iterable[str]) -> dict[tuple[str, str], int]:
    """`cuobjdump -elf` output -> the most threads per CTA of each kernel's launch bounds
    (EIATTR_MAX_THREADS in its .nv.info.<symbol> section; none without launch bounds)."""
    arch, section, wanted, threads = None, None, False, {}
    for line in elf:
        if m := re.match(r"arch = (\S+)", line):
            arch = m.group(1)
        elif line.startswith("."):
            m = re.match(r"\.nv\.info\.(\S+)$", line)
            section, wanted = (m.group(1) if m else None), False
        elif section and "EIATTR_MAX_THREADS" in line:
            wanted = True
        elif wanted and (m := re.match(r"\s*Value:\s+((?:0x[0-9a-f]+\s*){3})", line)):
            threads[(arch, section)] = math.prod(int(v, 16) for v in m.group(1).split())
            wanted = False
    return threads


def parse_dynamic_shared(ptx: Iterable[str]) -> set[str]:
    """`cuobjdump -ptx` output -> the kernels (mangled) that name an `.extern .shared` array:
    those that take shared memory at launch."""
    externs: set[str] = set()
    kernels, entry = set(), None
    for line in ptx:
        if m := re.match(r"\.extern \.shared .*?(\S+)\[\];", line):
            externs.add(m.group(1))
        elif m := re.match(r"(?:\.\w+ )*\.entry (\S+)\(", line):
            entry = m.group(1)
        elif re.match(r"(?:\.\w+ )*\.func", line):
            entry = None
        elif entry and externs and any(e in line for e in externs):
            kernels.add(entry)
    return kernels


def read_object(cuobjdump: str, obj: Path, unit: str, kernels: dict[tuple[str, str], list[Kernel]],
                dynamic_shared: set[str]) -> bool:
    """Adds obj's kernels to `kernels` and those taking shared memory at launch to
    `dynamic_shared`; whether obj holds PTX to tell the latter by."""
    found = parse_resources(output_lines([cuobjdump, "-res-usage", str(obj)]))
    for key, threads in parse_max_threads(output_lines([cuobjdump, "-elf", str(obj)])).items():
        if key in found:
            found[key].threads = threads
    # A kernel compiled into several units is one row unless its resources differ between them.
    for key, k in found.items():
        usage = (k.regs, k.stack, k.shared, k.local, k.threads)
        seen = next((o for o in kernels[key] if (o.regs, o.stack, o.shared, o.local, o.threads) == usage), None)
        if seen is None:
            kernels[key].append(k)
            seen = k
        seen.units.add(unit)
    ptx = subprocess.run([cuobjdump, "-ptx", str(obj)], capture_output=True, text=True)
    if ptx.returncode != 0 or ".entry" not in ptx.stdout:
        return False  # sm_90a objects embed no PTX (CMakeLists.txt)
    dynamic_shared |= parse_dynamic_shared(ptx.stdout.splitlines())
    return True


def enum_names(source_dir: Path) -> dict[str, dict[int, str]]:
    """`enum class` enumerators by value, from the library's headers (for template arguments)."""
    enums: dict[str, dict[int, str]] = {}
    for header in sorted((source_dir / "include").rglob("*.[hc]*")):
        text = header.read_text(errors="replace")
        for m in re.finditer(r"enum\s+class\s+(\w+)\s*(?::\s*[\w:]+\s*)?\{([^}]*)\}", text):
            values, nxt = {}, 0
            body = re.sub(r"//[^\n]*|/\*.*?\*/", "", m.group(2), flags=re.S)
            for item in filter(None, (s.strip() for s in body.split(","))):
                ident, _, value = (p.strip() for p in item.partition("="))
                try:
                    nxt = int(value, 0) if value else nxt
                except ValueError:
                    break
                values[nxt] = ident[1:] if re.match(r"k[A-Z0-9]", ident) else ident
                nxt += 1
            enums.setdefault(m.group(1), values)
    return enums


def short_names(symbols: list[str], enums: dict[str, dict[int, str]]) -> dict[str, tuple[str, str]]:
    """symbol -> (op, kernel with its template arguments), demangled by c++filt and trimmed."""
    out = subprocess.run(["c++filt"], input="\n".join(symbols), check=True, capture_output=True, text=True)
    names = {}
    for symbol, full in zip(symbols, out.stdout.splitlines()):
        text = re.sub(r"^void ", "", full)
        # Drop the parameter list: the last top-level parenthesised group.
        depth = 0
        for i in range(len(text) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(text[i], 0)
            if depth == 0 and text[i] == "(":
                text = text[:i]
                break
        text = re.sub(r"\(qflash::(?:\w+::)*(\w+)\)(-?\d+)",
                      lambda m: enums.get(m.group(1), {}).get(int(m.group(2)), m.group(0)), text)
        text = re.sub(r"qflash::arch::Sm\w+,?\s*", "", text).replace("<>", "")
        text = re.sub(r"qflash::(?:kernels::)?", "", text)
        m = re.match(r"((?:\w+::)*)(.*)", text)
        scope = [s for s in m.group(1).split("::") if s]
        op = "/".join([scope[0].removesuffix("_cuda")] + scope[1:]) if scope else "(global)"
        names[symbol] = (op, m.group(2))
    return names


def compile_times(build: Path) -> list[tuple[float, str]]:
    log = build / ".ninja_log"
    if not log.exists():
        return []
    last: dict[str, float] = {}
    for line in log.read_text().splitlines()[1:]:
        parts = line.split("\t")
        if len(parts) >= 4 and parts[3].endswith(".cu.o"):
            last[parts[3]] = (int(parts[1]) - int(parts[0])) / 1000.0
    return sorted(((t, o) for o, t in last.items()), reverse=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build", type=Path, help="a CMake build directory with CUDA objects (e.g. build/ci)")
    ap.add_argument("--cuobjdump", required=True)
    ap.add_argument("--source-dir", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--out", type=Path, help="also write the report here")
    args = ap.parse_args()

    objects = sorted(args.build.rglob("*.cu.o"))
    if not objects:
        sys.exit(f"cuda_report: no CUDA objects (*.cu.o) under {args.build}: build a CUDA preset first")
    kernels: dict[tuple[str, str], list[Kernel]] = defaultdict(list)
    dynamic_symbols: set[str] = set()
    have_ptx = False
    for obj in objects:
        have_ptx |= read_object(args.cuobjdump, obj, obj.name.removesuffix(".cu.o"), kernels, dynamic_symbols)
    names = short_names(sorted({sym for _, sym in kernels} | dynamic_symbols), enum_names(args.source_dir))
    # Names leave the arch out, so sm_80's PTX tells it for both archs.
    dynamic = {names[sym] for sym in dynamic_symbols}

    lines: list[str] = []
    say = lines.append
    say(f"CUDA kernels of {args.build}: {len(objects)} device objects")
    say("warps/SM: resident warps per SM (of 64) that the registers, the launch bounds' most threads per CTA")
    say("(max thr; a launch may take fewer), static shared memory and the 32-CTA cap allow, by the CUDA")
    say("occupancy calculator's rules; limit: which of those binds. smem +dyn: the kernel takes more")
    say("shared memory at launch, so its warps/SM is an upper bound (≤).")
    if not have_ptx:
        say("No object here holds PTX, so kernels that take shared memory at launch are not marked.")
    stacks: list[str] = []
    for arch in sorted({a for a, _ in kernels}):
        rows = []
        for (a, sym), variants in kernels.items():
            if a != arch:
                continue
            op, name = names[sym]
            for k in variants:
                warps, limiter = occupancy(k)
                where = "" if len(variants) == 1 else f"  [{', '.join(sorted(k.units))}]"
                rows.append((op, name + where, k, warps, limiter, (op, name) in dynamic))
                if k.stack or k.local:
                    stacks.append(f"  {arch} {op}::{name}: stack {k.stack} B, local {k.local} B")
        rows.sort(key=lambda r: (r[0], r[1]))
        say("")
        say(f"== {arch}: {len(rows)} kernels; registers max {max(r[2].regs for r in rows)}, "
            f"median {sorted(r[2].regs for r in rows)[len(rows) // 2]}")
        say(f"{'op':<18} {'regs':>4} {'stack':>5} {'smem':>10} {'max thr':>7} {'warps/SM':>8} {'limit':<7} kernel")
        for op, name, k, warps, limiter, dyn in rows:
            smem = f"{k.shared}+dyn" if dyn else str(k.shared)
            resident = "?" if not warps else f"≤{warps}" if dyn else str(warps)
            say(f"{op:<18} {k.regs:>4} {k.stack:>5} {smem:>10} {k.threads or '?':>7} {resident:>8} {limiter:<7} {name}")
    say("")
    say(f"== stack frames, per kernel and arch (register spills, local arrays, or a library routine's "
        f"scratch): {len(stacks)}")
    lines.extend(stacks or ["  none"])
    times = compile_times(args.build)
    if times:
        say("")
        say(f"== compile time per CUDA TU, the latest .ninja_log entry of each (a ccache hit takes seconds): "
            f"{sum(t for t, _ in times):.0f} s in all")
        for t, obj in times:
            say(f"{t:>8.1f} s  {obj}")
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
