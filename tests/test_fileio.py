"""fileio.py: folders written through a temporary folder end up with ordinary modes, next to their target."""

import os
import stat

from tes_grpo.fileio import give_default_modes, temporary_folder


def test_temporary_folder_then_default_modes(tmp_path):
    old = os.umask(0o022)
    try:
        target = tmp_path / "out" / "model"
        temp = temporary_folder(target)
        assert temp.parent == target.parent and temp.name.startswith(".model.tmp-")
        assert stat.S_IMODE(temp.stat().st_mode) == 0o700  # mkdtemp's mode, until the folder is complete
        (temp / "sub").mkdir(mode=0o700)
        weights = temp / "sub" / "weights.bin"
        weights.write_bytes(b"x")
        os.chmod(weights, 0o600)  # as files written through mkstemp are
        give_default_modes(temp)
        modes = {p.relative_to(temp).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in [temp, *temp.rglob("*")]}
        assert modes == {".": 0o755, "sub": 0o755, "sub/weights.bin": 0o644}
    finally:
        os.umask(old)
