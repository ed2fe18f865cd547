"""The wheel carries the Lua files and its console script works from a fresh venv."""

from __future__ import annotations

import subprocess
import sys
import venv
import zipfile
from pathlib import Path

from taskiq_atomic_claim.harness.embedded_server import LocalServer, default_binary

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str | Path, cwd: Path | None = None) -> str:
    result = subprocess.run(
        [str(arg) for arg in args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=cwd,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result.stdout


def test_wheel_installs_into_a_fresh_venv_and_loads_the_library(tmp_path: Path) -> None:
    run(sys.executable, "-m", "build", "--wheel", "--outdir", tmp_path / "dist", ROOT)
    [wheel] = (tmp_path / "dist").glob("taskiq_atomic_claim-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    lua_files = sorted(p.name for p in (ROOT / "lua").rglob("*.lua"))
    packaged = sorted(
        Path(name).name for name in names if name.startswith("taskiq_atomic_claim/lua/")
    )
    assert packaged == lua_files
    assert "taskiq_atomic_claim/py.typed" in names
    assert "taskiq_atomic_claim/web/page.html" in names  # serve's page

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    run(python, "-m", "pip", "install", "--quiet", wheel)
    with LocalServer(default_binary()) as server:
        # Run from a directory without the source tree, so only the wheel counts.
        out = run(
            env_dir / "bin" / "taskiq-atomic-claim",
            "load",
            "--url",
            server.url,
            cwd=tmp_path,
        )
        assert "loaded taskiq_atomic_claim_" in out
        check = run(
            env_dir / "bin" / "taskiq-atomic-claim",
            "check",
            "--url",
            server.url,
            cwd=tmp_path,
        )
        assert "current" in check
