"""The training corpus of models/qwen3_5_moe-micro: Jane Austen's six completed novels, as shipped by
the Debian package r-cran-janeaustenr (texts from Project Gutenberg; the novels are in the public
domain; the R package and its Debian packaging are MIT-licensed).

The package stores the novels as R character vectors (one element per line of the Gutenberg text) in
an R lazy-load database (data/Rdata.rdx + data/Rdata.rdb).  This module reads that database with a
minimal R-serialization (XDR, format 2/3) reader, so neither R nor the package's dependencies
(r-base-core) are needed: the .deb is fetched with `apt-get download` and unpacked with
`dpkg-deb -x` into a cache folder, and its SHA-256 is checked.

    import austen_corpus
    books = austen_corpus.load_books()   # [(title, text)], in BOOKS order
"""
import bz2
import gzip
import hashlib
import lzma
import os
import shutil
import struct
import subprocess
import tempfile
import zlib

DEB_PACKAGE = "r-cran-janeaustenr"
DEB_VERSION = "1.0.0-1"
DEB_SHA256 = "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95"
DATA_DIR = "usr/lib/R/site-library/janeaustenr/data"
# (R object name, title), in publication order
BOOKS = [
    ("sensesensibility", "Sense and Sensibility"),
    ("prideprejudice", "Pride and Prejudice"),
    ("mansfieldpark", "Mansfield Park"),
    ("emma", "Emma"),
    ("northangerabbey", "Northanger Abbey"),
    ("persuasion", "Persuasion"),
]
DEFAULT_CACHE = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".venv", "corpus")


# ----------------------------------------------------------------------------- R unserialize (subset)
class _Reader:
    """Enough of R's serialize() XDR format for data objects: NULL, symbols, pairlists, character /
    logical / integer / double / list vectors with attributes, and references."""

    def __init__(self, buf):
        self.b, self.p, self.refs = buf, 0, []
        fmt = self.raw(2)
        if fmt != b"X\n":
            raise ValueError(f"not an XDR R serialization: {fmt!r}")
        version = self.int()
        self.int()  # writer R version
        self.int()  # minimal reader R version
        if version == 3:
            self.raw(self.int())  # native encoding
        elif version != 2:
            raise ValueError(f"R serialization version {version}")

    def raw(self, n):
        v = self.b[self.p:self.p + n]
        self.p += n
        return v

    def int(self):
        v = struct.unpack_from(">i", self.b, self.p)[0]
        self.p += 4
        return v

    def length(self):
        n = self.int()
        if n == -1:  # long vector
            hi, lo = self.int(), self.int()
            n = (hi << 32) + lo
        return n

    def item(self):
        flags = self.int()
        t = flags & 0xFF
        has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if t == 254:  # NILVALUE_SXP
            return None
        if t in (253, 242, 241, 252, 251, 247):  # global/empty/base env, unbound, missing, base ns
            return None
        if t == 255:  # REFSXP
            idx = flags >> 8
            if idx == 0:
                idx = self.int()
            return self.refs[idx - 1]
        if t == 1:  # SYMSXP
            name = self.item()
            self.refs.append(name)
            return name
        if t in (2, 6, 17, 239, 240):  # LISTSXP, LANGSXP, DOTSXP, ATTRLISTSXP, ATTRLANGSXP: as a dict
            out = {}
            while True:
                attr = self.item() if has_attr else None
                del attr
                tag = self.item() if has_tag else None
                out[tag if tag is not None else len(out)] = self.item()
                flags = self.int()
                t = flags & 0xFF
                has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
                if t == 254:
                    return out
                if t not in (2, 6, 17, 239, 240):
                    raise ValueError(f"unsupported pairlist tail type {t}")
        if t == 9:  # CHARSXP
            n = self.int()
            return None if n == -1 else self.raw(n).decode("utf-8")
        if t == 16:  # STRSXP
            v = [self.item() for _ in range(self.length())]
        elif t == 19 or t == 20:  # VECSXP, EXPRSXP
            v = [self.item() for _ in range(self.length())]
        elif t in (10, 13):  # LGLSXP, INTSXP
            n = self.length()
            v = list(struct.unpack_from(f">{n}i", self.b, self.p))
            self.p += 4 * n
        elif t == 14:  # REALSXP
            n = self.length()
            v = list(struct.unpack_from(f">{n}d", self.b, self.p))
            self.p += 8 * n
        elif t == 24:  # RAWSXP
            v = self.raw(self.length())
        else:
            raise ValueError(f"unsupported R SEXP type {t}")
        if has_attr:
            attrs = self.item()
            if isinstance(attrs, dict) and "names" in attrs and isinstance(v, list):
                return dict(zip(attrs["names"], v))
        return v


def _unserialize(buf):
    return _Reader(buf).item()


def _decompress_rdb_entry(blob):
    """R lazy-load DB entry: 4-byte big-endian uncompressed length, then either zlib data or a type
    byte ('Z' zlib, '2' bzip2, 'X' xz, '0' none) and the data."""
    n = struct.unpack_from(">I", blob, 0)[0]
    kind = blob[4:5]
    if kind == b"Z":
        out = zlib.decompress(blob[5:])
    elif kind == b"2":
        out = bz2.decompress(blob[5:])
    elif kind == b"X":
        out = lzma.decompress(blob[5:])
    elif kind == b"0":
        out = blob[5:]
    else:
        out = zlib.decompress(blob[4:])
    if len(out) != n:
        raise ValueError("lazy-load DB entry: length mismatch")
    return out


def read_lazyload_db(data_dir):
    """{object name: R value} for every variable of data/Rdata.{rdx,rdb}."""
    index = _unserialize(gzip.decompress(open(os.path.join(data_dir, "Rdata.rdx"), "rb").read()))
    rdb = open(os.path.join(data_dir, "Rdata.rdb"), "rb").read()
    out = {}
    for name, (offset, length) in index["variables"].items():
        out[name] = _unserialize(_decompress_rdb_entry(rdb[offset:offset + length]))
    return out


# ----------------------------------------------------------------------------- package
def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def ensure_package(cache=DEFAULT_CACHE):
    """Unpacked package root (a folder holding usr/lib/R/...).  Uses an installed copy of the package
    when its version matches, else `apt-get download` + `dpkg-deb -x` into `cache`."""
    installed = os.path.join("/", DATA_DIR)
    try:
        v = subprocess.run(["dpkg-query", "-W", "-f=${Version}", DEB_PACKAGE], capture_output=True,
                           text=True).stdout.strip()
    except FileNotFoundError:
        v = ""
    if v == DEB_VERSION and os.path.exists(os.path.join(installed, "Rdata.rdb")):
        return "/", "installed"
    deb = os.path.join(cache, f"{DEB_PACKAGE}_{DEB_VERSION}_all.deb")
    root = os.path.join(cache, "root")
    if not (os.path.exists(deb) and sha256_file(deb) == DEB_SHA256):
        os.makedirs(cache, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=cache)
        try:
            os.chmod(tmp, 0o777)  # apt's _apt user may write there
            r = subprocess.run(["apt-get", "download", f"{DEB_PACKAGE}={DEB_VERSION}"], cwd=tmp,
                               capture_output=True, text=True)
            got = [f for f in os.listdir(tmp) if f.endswith(".deb")]
            if r.returncode != 0 or not got:
                raise SystemExit(f"could not fetch the Debian package {DEB_PACKAGE}={DEB_VERSION} "
                                 f"(run `apt-get update` first?):\n{r.stderr}")
            shutil.move(os.path.join(tmp, got[0]), deb)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if sha256_file(deb) != DEB_SHA256:
            raise SystemExit(f"{deb}: SHA-256 mismatch (expected {DEB_SHA256})")
        shutil.rmtree(root, ignore_errors=True)
    if not os.path.exists(os.path.join(root, DATA_DIR, "Rdata.rdb")):
        shutil.rmtree(root, ignore_errors=True)
        subprocess.run(["dpkg-deb", "-x", deb, root], check=True)
    return root, deb


def load_books(cache=DEFAULT_CACHE):
    """[(title, text)] for the six novels: the package's lines joined with "\\n" (the package keeps
    Gutenberg's line breaks and blank lines), in BOOKS order."""
    root, _ = ensure_package(cache)
    db = read_lazyload_db(os.path.join(root, DATA_DIR))
    books = []
    for name, title in BOOKS:
        lines = db[name]
        if not isinstance(lines, list) or not all(isinstance(s, str) for s in lines):
            raise ValueError(f"{name}: not a character vector")
        books.append((title, "\n".join(lines)))
    return books


if __name__ == "__main__":
    for title, text in load_books():
        print(f"{title}: {len(text)} chars, {len(text.split())} words; starts {text[:60]!r}")
