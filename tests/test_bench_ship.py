"""`bench/ship_model.py`: a chunked model, the data and the site bundle cut into what one call to the GPU machine
carries, and put back together there, call by call (the calls simulated: what each carries is moved into a fresh
`.ship`, then `receive` runs)."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import shutil
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("bench_ship_model", ROOT / "bench" / "ship_model.py")
ship = importlib.util.module_from_spec(SPEC)
sys.modules["bench_ship_model"] = ship  # its dataclasses look their module up
SPEC.loader.exec_module(ship)


@pytest.fixture
def model(tmp_path: Path) -> tuple[Path, list[bytes]]:
    """A model in three chunks of 1,000 bytes and a last of 300, and its config (size, chunk_bytes, sha256)."""
    chunks = [bytes([k]) * 1000 for k in range(3)] + [b"z" * 300]
    folder = tmp_path / "chunks"
    folder.mkdir()
    for k, chunk in enumerate(chunks):
        (folder / f"part{k + 1}.bin").write_bytes(chunk)
    whole = b"".join(chunks)
    config = tmp_path / "model.yaml"
    config.write_text(yaml.safe_dump({"name": "m", "gguf_chunks": {
        "files": f"{folder}/part*.bin", "size": len(whole), "chunk_bytes": 1000,
        "sha256": hashlib.sha256(whole).hexdigest()}}))
    return config, chunks


def test_pieces_carried_one_a_call_are_joined_into_the_site_and_the_models_chunks_and_checked(
        model, tmp_path: Path, capsys) -> None:
    """`prepare` cuts pieces of 700 bytes: the site bundle's first (an incompressible 1,500-byte file makes it 3), then
    the model's (5, the last 500) across the chunks' bounds; the data's tarball rides with the last piece. The site
    is unpacked once its last piece is held; the model waits for its pieces; after the last, its four chunk files are
    the originals, and a call carrying nothing more finds them there. `receive --whole` (the last call's, before
    the chain starts) fails in one line while the data and the model are missing, and passes once all is there."""
    config, chunks = model
    data = tmp_path / "data"
    (data / "gsm8k").mkdir(parents=True)
    (data / "gsm8k" / "test.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    noise = b"".join(hashlib.sha256(str(k).encode()).digest() for k in range(47))  # does not compress
    bundle = _site_bundle(tmp_path / "site.tar.xz", {"pkg/__init__.py": b"x=1\n", "pkg/noise.bin": noise[:1500]})
    out = tmp_path / "out"
    calls = _main(["--model-config", str(config), "--ship", str(out), "prepare", "--chunks",
                   str(tmp_path / "chunks" / "part*.bin"), "--piece-bytes", "700", "--data", str(data),
                   "--no-wheels", "--site-bundle", str(bundle)]).splitlines()
    site_pieces = sorted(out.glob("site.*"), key=ship._natural)
    assert len(site_pieces) == -(-bundle.stat().st_size // 700) >= 3
    pieces = sorted(out.glob("model.*"), key=ship._natural)
    assert [p.name for p in pieces] == [f"model.{k}-of-5" for k in range(1, 6)]
    assert [p.stat().st_size for p in pieces] == [700, 700, 700, 700, 500]
    assert "0. carry []" in calls  # the call that starts the machine carries nothing
    carried = [line for line in calls if line[:1].isdigit() and not line.startswith("0.")]
    assert len(carried) == len(site_pieces) + 5 and all(f"site.{k + 1}-of-" in carried[k]
                                                        for k in range(len(site_pieces)))
    assert ship.DATA_FILE in carried[-1]
    assert (out / "calls.md").read_text().strip() == "\n".join(calls).strip()
    side = [out / ship.DATA_FILE]

    there = {"site": tmp_path / "site", "held": tmp_path / "held", "data": tmp_path / "data_there",
             "chunks": tmp_path / "joined"}
    tree = tmp_path / "tree"

    def receive_args(*extra: str) -> list[str]:
        return ["--model-config", str(config), "--ship", str(tree / ".ship"), "receive", "--site",
                str(there["site"]), "--held", str(there["held"]), "--data-into", str(there["data"]),
                "--chunks-into", str(there["chunks"]), *extra]

    def call(*carry: Path) -> str:
        _fresh(tree / ".ship")
        for path in carry:
            shutil.copy(path, tree / ".ship" / path.name)
        return _main(receive_args())

    for k, piece in enumerate(site_pieces[:-1]):
        assert f"site: {k + 1} of {len(site_pieces)} pieces" in call(piece)
    assert "site: unpacked" in call(site_pieces[-1])
    assert (there["site"] / "pkg" / "__init__.py").read_text() == "x=1\n"
    assert (there["site"] / "pkg" / "noise.bin").read_bytes() == noise[:1500]
    assert (there["site"] / "bin" / "ray").stat().st_mode & 0o111 and not list(there["held"].glob("site.*"))
    for k, piece in enumerate(pieces[:-1]):
        assert f"model: {k + 1} of 5 pieces" in call(piece)
    _fresh(tree / ".ship")
    assert ship.main(receive_args("--whole")) == 2  # a chain started now would find no model and no data
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "not whole: the data, the model missing" in error[0], error
    last = call(pieces[-1], *side)
    assert "model: 4 chunk files" in last and "SHA-256 checked" in last and "data: unpacked" in last
    assert [(there["chunks"] / f"part{k + 1}.bin").read_bytes() for k in range(4)] == chunks
    assert (there["data"] / "gsm8k" / "test.jsonl").is_file()
    assert "4 chunk files in" in call() and "before" in call()
    assert ship.main(receive_args("--whole")) == 0


def test_a_piece_of_another_model_fails_the_check_in_one_line(model, tmp_path: Path, capsys) -> None:
    config, _ = model
    held = tmp_path / "held"
    held.mkdir()
    (held / "model.1-of-1").write_bytes(b"not the model")
    args = ["--model-config", str(config), "--ship", str(tmp_path / "empty"), "receive",
            "--site", str(tmp_path / "site"), "--held", str(held), "--chunks-into",
            str(tmp_path / "joined"), "--data-into", str(tmp_path / "d")]
    (tmp_path / "empty").mkdir()
    assert ship.main(args) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "the pieces join into 13 bytes" in error[0] and "prepare and ship them again" in error[0]


def test_wheels_with_scripts_installed_into_the_site_leave_its_ray_command(model, tmp_path: Path) -> None:
    """The site bundle unpacked, then a call carrying a wheel that has a script of its own (as gguf's and antlr4's
    do): pip's `--target --upgrade` replaces the site's `bin` folder, and `ray` must be there after it (the first
    Qwen session's chain failed at `ray start` so)."""
    config, _ = model
    ship_dir = _fresh(tmp_path / "ship")
    _site_bundle(ship_dir / "site.1-of-1", {"pkg/__init__.py": b""})
    _wheel_with_script(_fresh(ship_dir / ship.WHEELS_DIR) / "toolpkg-1.0-py3-none-any.whl")
    site = tmp_path / "site"
    out = _main(["--model-config", str(config), "--ship", str(ship_dir), "receive",
                 "--site", str(site), "--held", str(tmp_path / "held"), "--data-into", str(tmp_path / "d"),
                 "--chunks-into", str(tmp_path / "joined")])
    assert "wheels: 1 installed" in out
    assert (site / "bin" / "tool").is_file() and (site / "toolpkg" / "__init__.py").is_file()
    assert (site / "bin" / "ray").stat().st_mode & 0o111 and "ray.scripts" in (site / "bin" / "ray").read_text()


def test_a_locked_wheel_set_travels_in_pieces_and_is_installed_once_whole(model, tmp_path: Path) -> None:
    """`prepare-wheels` tars a lock's wheels and cuts the tar into pieces named after the lock, beside the model's
    pieces already in .ship (which stay); `receive` holds them call by call and, with the last, installs the wheels
    (pip checking each against the lock's hash) into their own folder, once."""
    config, _ = model
    wheels = _fresh(tmp_path / "wheels")
    _wheel_with_script(wheels / "toolpkg-1.0-py3-none-any.whl")
    _wheel_with_script(wheels / "otherpkg-2.0-py3-none-any.whl", "otherpkg", "2.0", payload=bytes(range(256)) * 8)
    lock = _lock(tmp_path / "locked.txt", wheels)
    out = _fresh(tmp_path / "out")
    (out / "model.1-of-1").write_bytes(b"a model piece of another preparation")
    bundle = _site_bundle(tmp_path / "site.tar.xz", {"pkg/__init__.py": b""})
    calls = _main(["--model-config", str(config), "--ship", str(out), "prepare-wheels", "--lock", str(lock),
                   "--wheels-from", str(wheels), "--piece-bytes", "2000", "--site-bundle", str(bundle)])
    pieces = sorted(out.glob("locked.*-of-*"), key=ship._natural)
    tar_bytes = sum(p.stat().st_size for p in pieces)
    assert len(pieces) == -(-tar_bytes // 2000) >= 3 and {p.stat().st_size for p in pieces[:-1]} == {2000}
    assert (out / "model.1-of-1").is_file() and "site.1-of-1" in calls and str(pieces[-1].name) in calls
    assert (out / "calls-locked.md").read_text().strip() == calls.strip() and calls.startswith("# 2 wheels of locked")

    target, held = tmp_path / "vsite", tmp_path / "held"

    def call(*carry: Path) -> str:
        ship_dir = _fresh(tmp_path / "tree" / ".ship")
        for path in carry:
            shutil.copy(path, ship_dir / path.name)
        return _main(["--model-config", str(config), "--ship", str(ship_dir), "receive",
                      "--site", str(tmp_path / "site"), "--held", str(held), "--data-into",
                      str(tmp_path / "d"), "--chunks-into", str(tmp_path / "joined"), "--lock", str(lock),
                      "--lock-into", str(target)])

    for k, piece in enumerate(pieces[:-1]):
        assert f"locked: {k + 1} of {len(pieces)} pieces" in call(piece)
    assert "locked: 2 wheels installed into" in call(pieces[-1])
    assert (target / "toolpkg" / "__init__.py").is_file() and (target / "otherpkg" / "data.bin").read_bytes() == \
        bytes(range(256)) * 8
    assert not list(held.glob("locked*")) and "locked: installed in" in call()


def test_a_wheel_that_is_not_the_locked_one_fails_the_install_in_one_line(model, tmp_path: Path, capsys) -> None:
    config, _ = model
    wheels = _fresh(tmp_path / "wheels")
    _wheel_with_script(wheels / "toolpkg-1.0-py3-none-any.whl")
    lock = _lock(tmp_path / "locked.txt", wheels)
    _wheel_with_script(wheels / "toolpkg-1.0-py3-none-any.whl", payload=b"changed since it was locked")
    out = _fresh(tmp_path / "out")
    _main(["--model-config", str(config), "--ship", str(out), "prepare-wheels", "--lock", str(lock), "--wheels-from",
           str(wheels), "--site-bundle", str(_site_bundle(tmp_path / "site.tar.xz", {"pkg/__init__.py": b""}))])
    held = _fresh(tmp_path / "held")
    for piece in out.glob("locked.*-of-*"):
        shutil.move(piece, held / piece.name)
    assert ship.main(["--model-config", str(config), "--ship", str(_fresh(tmp_path / "empty")), "receive",
                      "--site", str(tmp_path / "site"), "--held", str(held),
                      "--data-into", str(tmp_path / "d"), "--chunks-into", str(tmp_path / "joined"), "--lock",
                      str(lock), "--lock-into", str(tmp_path / "vsite")]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("ship_model: error: pip could not install the 1 wheels of locked")
    assert not (tmp_path / "vsite" / "toolpkg").exists()


def _site_bundle(path: Path, files: dict[str, bytes]) -> Path:
    """A site bundle as gpu-site makes one: a tar.xz of the files."""
    with tarfile.open(path, "w:xz") as tar:
        for name, content in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    return path


def _lock(path: Path, wheels: Path) -> Path:
    """A pip requirements file pinning each wheel of `wheels` with its hash."""
    lines = []
    for wheel in sorted(wheels.glob("*.whl")):
        name, version = wheel.name.split("-")[:2]
        lines.append(f"{name}=={version} --hash=sha256:{hashlib.sha256(wheel.read_bytes()).hexdigest()}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _wheel_with_script(path: Path, package: str = "toolpkg", version: str = "1.0", payload: bytes = b"") -> None:
    """A minimal wheel: a package (with `payload` as its data.bin) and a script in its `.data/scripts` (pip puts it
    in the target's `bin`)."""
    import base64
    import zipfile

    info = f"{package}-{version}"
    files = {f"{package}/__init__.py": b"", f"{package}/data.bin": payload,
             f"{info}.data/scripts/tool": b"#!python\nprint(1)\n",
             f"{info}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode(),
             f"{info}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                        b"Tag: py3-none-any\n"}
    record = [f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
              f"{len(data)}" for name, data in files.items()]
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
        wheel.writestr(f"{info}.dist-info/RECORD", "\n".join([*record, f"{info}.dist-info/RECORD,,"]) + "\n")


def _fresh(folder: Path) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def _main(args: list[str]) -> str:
    import contextlib

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert ship.main(args) == 0
    return printed.getvalue()
