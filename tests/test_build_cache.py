"""setup.py's build cache (HVD_TERNGRAD_BUILD_CACHE, which scripts/install.sh sets): an extension comes from the
cache only where every input of its binary is the same, a clone elsewhere finds what another clone built, and the
cache keeps the binaries used last."""
import os
import runpy
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup_py():
    """setup.py's names, without running setup()."""
    return runpy.run_path(str(ROOT / "setup.py"), run_name="setup_under_test")


class _Compiler:
    compiler_so = ["gcc", "-O2"]
    compiler_cxx = ["g++"]
    linker_so = ["gcc", "-shared"]


def _clone(tmp_path: Path, name: str) -> Path:
    """setup.py and csrc/ in a folder of their own, as a clone elsewhere has them."""
    clone = tmp_path / name
    shutil.copytree(ROOT / "csrc", clone / "csrc")
    shutil.copy(ROOT / "setup.py", clone)
    (clone / "hvd_terngrad").mkdir()  # where --inplace puts the binaries
    return clone


def test_the_key_follows_every_input_and_not_the_clones_folder(setup_py, tmp_path):
    key, ext = setup_py["extension_key"], setup_py["EXTENSIONS"][0]
    a, b = _clone(tmp_path, "a"), _clone(tmp_path, "b")
    base = key(ext, _Compiler(), str(a))
    assert key(ext, _Compiler(), str(b)) == base  # another clone, the same inputs
    (b / "csrc" / "terngrad.h").write_text((b / "csrc" / "terngrad.h").read_text() + "\n// an edit\n")
    assert key(ext, _Compiler(), str(b)) != base  # any file of csrc/, headers too
    (a / "setup.py").write_text((a / "setup.py").read_text() + "\n")
    assert key(ext, _Compiler(), str(a)) != base
    a = _clone(tmp_path, "a2")
    other = _Compiler()
    other.compiler_so = ["gcc", "-O0"]  # CFLAGS reach the compiler's commands
    assert key(ext, other, str(a)) != base
    flags = ext.extra_compile_args
    ext.extra_compile_args = flags + ["-g"]  # HVD_TERNGRAD_DEBUG's flags, say
    try:
        assert key(ext, _Compiler(), str(a)) != base
    finally:
        ext.extra_compile_args = flags
    assert key(ext, _Compiler(), str(a)) == base


def test_the_cache_keeps_the_binaries_used_last(setup_py, tmp_path):
    now = time.time()
    for i in range(11):
        (tmp_path / f"hvd_terngrad._ddp_hook-{i:02d}.so").write_bytes(b"x")
        os.utime(tmp_path / f"hvd_terngrad._ddp_hook-{i:02d}.so", (now - i, now - i))
    (tmp_path / "hvd_terngrad._terngrad_cpu-old.so").write_bytes(b"x")
    os.utime(tmp_path / "hvd_terngrad._terngrad_cpu-old.so", (now - 99, now - 99))
    setup_py["prune_cache"](str(tmp_path), "hvd_terngrad._ddp_hook", keep=8)
    assert sorted(p.name for p in tmp_path.iterdir()) == \
        [f"hvd_terngrad._ddp_hook-{i:02d}.so" for i in range(8)] + ["hvd_terngrad._terngrad_cpu-old.so"]


def _shared_cache() -> Path:
    """Where scripts/install.sh leaves built extensions ($CACHE/extensions there)."""
    base = os.environ.get("HVD_TERNGRAD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hvd_terngrad")
    return Path(base) / "extensions"


def _build(clone: Path, cache: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, HVD_TERNGRAD_BUILD_CACHE=str(cache))
    done = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=clone, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_a_clone_elsewhere_takes_the_extensions_from_the_cache_byte_for_byte(tmp_path):
    """A build in one folder fills the cache (or finds this tree's binaries there, as the install left them:
    the shared cache is copied in first, so that this test compiles only where the install did not cache), and a
    build of the same sources in another folder copies them and compiles nothing."""
    cache = tmp_path / "cache"
    cache.mkdir()
    if _shared_cache().is_dir():
        for f in _shared_cache().glob("hvd_terngrad.*"):
            shutil.copy2(f, cache)
    first = _clone(tmp_path, "first")
    _build(first, cache)
    built = sorted(p.name for p in (first / "hvd_terngrad").glob("*.so"))
    assert built, "setup.py built no extension"

    second = _clone(tmp_path, "second")
    copied = _build(second, cache)
    assert copied.stdout.count("from the build cache") == len(built), copied.stdout[-3000:]
    assert not list(second.rglob("*.o")), "an object file was compiled"
    for name in built:
        assert (second / "hvd_terngrad" / name).read_bytes() == (first / "hvd_terngrad" / name).read_bytes()
