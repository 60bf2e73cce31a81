#!/usr/bin/env python3
"""Make a CUDA-build torch wheel importable on a CPU-only machine without the
multi-GB nvidia-* / cuda-toolkit wheels.

Why: the Linux x86_64 torch wheels on the public package index are CUDA builds.
Installed with `pip install --no-deps torch`, `import torch` fails with e.g.
"libcufile.so.0: cannot open shared object file", because libtorch_cpu.so,
libtorch_cuda.so, ... have DT_NEEDED entries on libcudart, libcublas, libcudnn,
libnccl, ... and Python dlopens extension modules with RTLD_NOW, so every
imported symbol must resolve at load time.

What: for every shared library DT_NEEDED by torch's own ELF files that cannot be
found (neither inside torch/lib nor on the system), compile a tiny stub shared
object with that SONAME into torch/lib (torch's RPATH contains $ORIGIN).  Each
stub defines exactly the symbols torch imports from it, with the right ELF
symbol versions (e.g. `cudaMalloc@libcudart.so.13`), as functions returning
100 (== cudaErrorNoDevice / CUDA_ERROR_NO_DEVICE) -- so
torch.cuda.is_available() is False and torch reports "no device".  Functions
named *ErrorString / *ErrorName / *StatusString return a static C string.
Nothing on the CPU code paths calls into them.

libcuda.so.1 (the driver) is never stubbed: torch only dlopens it lazily.

Usage: cuda_stubs.py <site-packages>/torch      (idempotent; needs readelf + cc)
"""
import os
import re
import subprocess
import sys
import tempfile
from collections import defaultdict

MARKER = "QFLASH_CUDA_STUBS.txt"
NEVER_STUB = {"libcuda.so.1"}
CUDA_RE = re.compile(r"^lib(cudart|cublas|cublasLt|cudnn[a-z_]*|cufft|cufile|cupti|curand|cusolver|"
                     r"cusparse|cusparseLt|nccl|nvrtc|nvJitLink|nvshmem_host|nvToolsExt)\.so")


def sh(*args):
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


def is_elf(path):
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def needed(path):
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", sh("readelf", "-d", "-W", path))


def verneed_files(path):
    """version name -> file (soname) from .gnu.version_r"""
    out = {}
    cur = None
    for line in sh("readelf", "-V", "-W", path).splitlines():
        m = re.search(r"Version: \d+\s+File: (\S+)", line)
        if m:
            cur = m.group(1)
            continue
        m = re.search(r"Name: (\S+)\s+Flags", line)
        if m and cur:
            out[m.group(1)] = cur
    return out


def dynsyms(path):
    """yield (name, version or None, undefined: bool, bind, type)"""
    for line in sh("readelf", "--dyn-syms", "-W", path).splitlines():
        parts = line.split()
        if len(parts) < 8 or not parts[0].rstrip(":").isdigit():
            continue
        typ, bind, ndx, name = parts[3], parts[4], parts[6], parts[7]
        ver = None
        if "@@" in name:
            name, ver = name.split("@@", 1)
        elif "@" in name:
            name, ver = name.split("@", 1)
        yield name, ver, ndx == "UND", bind, typ


_LDCACHE = None


def system_lib(soname):
    global _LDCACHE
    if _LDCACHE is None:
        _LDCACHE = {}
        for line in sh("/sbin/ldconfig", "-p").splitlines():
            m = re.match(r"\s+(\S+) \(([^)]*)\) => (\S+)", line)
            if m and "x86-64" in m.group(2):
                _LDCACHE.setdefault(m.group(1), m.group(3))
    return _LDCACHE.get(soname)


def main(torch_dir):
    libdir = os.path.join(torch_dir, "lib")
    marker = os.path.join(libdir, MARKER)
    elfs = []
    for root, _, files in os.walk(torch_dir):
        for fn in files:
            p = os.path.join(root, fn)
            if ".so" in fn and is_elf(p) and not os.path.islink(p):
                elfs.append(p)
    if os.path.exists(marker):
        stubbed = set(open(marker).read().split())
    else:
        stubbed = set()
    local = {os.path.basename(p) for p in elfs} - stubbed

    # Which NEEDED sonames are missing?
    missing = set()
    for p in elfs:
        if os.path.basename(p) in stubbed:
            continue
        for so in needed(p):
            if so in local or so in NEVER_STUB:
                continue
            # Stub CUDA libraries even when the system has some (e.g. a CUDA
            # toolkit in /usr/local/cuda): a different CUDA minor version may
            # lack symbols this torch build imports, and we want CPU only.
            if so in stubbed or system_lib(so) is None or CUDA_RE.match(so):
                missing.add(so)
    if not missing:
        print("cuda_stubs: nothing to stub")
        return 0
    if missing <= stubbed and all(os.path.exists(os.path.join(libdir, so)) for so in missing):
        print(f"cuda_stubs: already stubbed ({len(stubbed)} libraries)")
        return 0

    # Symbols defined anywhere we can see (torch ELFs + system libs they need).
    defined = set()
    sys_paths = set()
    for p in elfs:
        if os.path.basename(p) in stubbed:
            continue
        for so in needed(p):
            sp = system_lib(so)
            if sp and so not in missing:
                sys_paths.add(sp)
    # ... and the Python interpreter (Py* symbols used by torch/_C*.so).
    exe = os.path.realpath(sys.executable)
    sys_paths.add(exe)
    for so in needed(exe):
        if so.startswith("libpython") and system_lib(so):
            sys_paths.add(system_lib(so))
    libpy = os.path.join(sys.base_prefix, "lib")
    for fn in os.listdir(libpy) if os.path.isdir(libpy) else []:
        if fn.startswith("libpython") and ".so" in fn:
            sys_paths.add(os.path.join(libpy, fn))
    for p in [q for q in elfs if os.path.basename(q) not in stubbed] + sorted(sys_paths):
        for name, _, und, _, _ in dynsyms(p):
            if not und:
                defined.add(name)

    per_lib = defaultdict(lambda: defaultdict(set))  # soname -> version -> {sym}
    for p in elfs:
        if os.path.basename(p) in stubbed:
            continue
        need = needed(p)
        miss_here = [so for so in need if so in missing]
        if not miss_here:
            continue
        vfile = verneed_files(p)
        for name, ver, und, bind, typ in dynsyms(p):
            if not und or not name or bind == "WEAK":
                continue
            if ver:
                ver = ver.split(" ")[0]
                so = vfile.get(ver)
                if so in missing:
                    per_lib[so][ver].add(name)
            elif name not in defined:
                # Unversioned symbol nobody defines: guess the owner by prefix.
                owner = None
                for prefix, so in (("cuFile", "libcufile"), ("cusparseLt", "libcusparseLt"),
                                   ("nccl", "libnccl"), ("nvshmem", "libnvshmem"),
                                   ("cudnn", "libcudnn"), ("cupti", "libcupti"),
                                   ("cublasLt", "libcublasLt"), ("cublas", "libcublas")):
                    if name.startswith(prefix):
                        owner = next((m for m in miss_here if m.startswith(so)), None)
                        break
                per_lib[owner or miss_here[0]][None].add(name)
    for so in missing:
        per_lib[so]  # ensure an (empty) stub exists for every missing soname

    with tempfile.TemporaryDirectory() as td:
        for so, vers in sorted(per_lib.items()):
            c = ['static const char qflash_stub_msg[] = "CUDA stub (qflash tools/cuda_stubs.py): no CUDA here";']
            vs = []
            for ver, syms in sorted(vers.items(), key=lambda kv: kv[0] or ""):
                for s in sorted(syms):
                    if re.search(r"(ErrorString|ErrorName|StatusString|StatusName|GetString)$", s):
                        c.append(f"const char *{s}(void) {{ return qflash_stub_msg; }}")
                    else:
                        c.append(f"long {s}(void) {{ return 100; }}")
                if ver:
                    vs.append(f"{ver} {{ global: {' '.join(s + ';' for s in sorted(syms))} }};")
            src = os.path.join(td, so + ".c")
            with open(src, "w") as f:
                f.write("\n".join(c) + "\n")
            cmd = ["cc", "-shared", "-fPIC", "-O0", "-o", os.path.join(libdir, so), src,
                   f"-Wl,-soname,{so}"]
            if vs:
                vfile = os.path.join(td, so + ".map")
                with open(vfile, "w") as f:
                    f.write("\n".join(vs) + "\n")
                cmd.append(f"-Wl,--version-script={vfile}")
            subprocess.run(cmd, check=True)
            nsym = sum(len(s) for s in vers.values())
            print(f"cuda_stubs: {so}: {nsym} stub symbols")
    with open(marker, "w") as f:
        f.write("\n".join(sorted(set(per_lib) | stubbed)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
