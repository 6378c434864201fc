"""Atomic outputs get the modes a plain write would (the umask's), so the unprivileged
user a container runs as can read an exported model."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import tempfile
from pathlib import Path

import pytest
import torch

from lmops import atomic
from lmops.runtime.engine import LLMEngine
from lmops.runtime.model import Llama
from lmops.runtime.model_config import TINY_SHAPE, LlamaConfig
from lmops.runtime.model_dir import current, export


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask():
    """Set the process umask for one test (restored after)."""
    old = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(old)


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o002])
def test_outputs_get_the_umask_modes(tmp_path, umask, mask):
    umask(mask)
    atomic.write_text(tmp_path / "a.txt", "x")
    with atomic.directory(tmp_path / "d") as tmp:
        (tmp / "f").write_text("y")
    assert mode(tmp_path / "a.txt") == 0o666 & ~mask
    assert mode(tmp_path / "d") == 0o777 & ~mask and mode(tmp_path / "d/f") == 0o666 & ~mask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "d"]  # no temporaries left


def test_a_saved_model_directory_gets_the_umask_modes(tmp_path, umask):
    """save_pretrained (artifacts/model) too: safetensors' own save_file would make the weights 0600."""
    umask(0o022)
    Llama(LlamaConfig(vocab_size=300, **TINY_SHAPE)).save_pretrained(tmp_path / "m")
    assert {p.name: mode(p) for p in (tmp_path / "m").iterdir()} == {
        "config.json": 0o644,
        "generation_config.json": 0o644,
        "model.safetensors": 0o644,
    }


def test_a_failed_directory_write_leaves_the_old_one(tmp_path):
    with atomic.directory(tmp_path / "d") as tmp:
        (tmp / "v").write_text("1")
    with pytest.raises(RuntimeError), atomic.directory(tmp_path / "d") as tmp:
        (tmp / "v").write_text("2")
        raise RuntimeError
    assert [p.name for p in tmp_path.iterdir()] == ["d"] and (tmp_path / "d/v").read_text() == "1"


@pytest.fixture
def public_dir():
    """A directory any user can traverse (pytest's tmp_path sits under a 0700 parent)."""
    path = Path(tempfile.mkdtemp(prefix="lmops-public-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def load_as_nobody(model_dir: Path) -> str:
    """Load `model_dir` the way the service does, in a child running as `nobody`;
    return "" or the child's error. A fork, not an exec: nobody may not be able to
    run this interpreter (it can live under /root)."""
    nobody = pwd.getpwnam("nobody")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop every privilege, load, report, never return to pytest
        error = ""
        try:
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            torch.set_num_threads(1)  # no OpenMP pool in a forked child
            LLMEngine.from_pretrained(model_dir, device="cpu", max_num_seqs=1)
        except BaseException as exc:  # reported to the parent
            error = f"{type(exc).__name__}: {exc}"
        finally:
            os.write(write_end, error.encode()[:4000])
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as fh:
        error = fh.read().decode()
    os.waitpid(pid, 0)
    return error


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another user needs root")
def test_an_export_is_readable_by_an_unprivileged_user(tiny_model_dir, public_dir, umask):
    umask(0o022)
    # The source is private, as a tempfile download or an old export is: modes must not leak.
    private = public_dir / "private"
    shutil.copytree(tiny_model_dir, private)
    private.chmod(0o700)
    for f in private.iterdir():
        f.chmod(0o600)
    assert "Permission denied" in load_as_nobody(private)  # the fault, reproduced

    served = public_dir / "production_service/model"
    export(private, served, model_version=3)
    assert mode(served) == mode(current(served)) == 0o755
    assert {f.name: mode(f) for f in current(served).iterdir()} == {f.name: 0o644 for f in private.iterdir()}
    assert load_as_nobody(served) == ""
