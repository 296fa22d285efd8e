"""liubai installs like any other package: the wheel holds the whole tree, and runs without the repo.

The wheel is built from a clean ``git clone`` of HEAD, so a leftover ``build/`` in the working tree
cannot leak files in (or hide missing ones). It is then installed with ``--no-deps`` into a fresh
venv whose only link to the test venv is a ``.pth`` file naming the test venv's site-packages as a
bare path: the dependencies resolve from there, but the editable install's finder (set up by
``.pth`` files that a bare path does not run) is not active, so every ``import tui...`` has to
come from the wheel. Commands run from a temporary directory, away from the repo.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LAYERS = ("agent", "runtime", "memory", "tui")

pytestmark = pytest.mark.skipif(
    shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs git and a git checkout"
)


def _run(*command: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        [str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, f"{command}: {result.stdout}\n{result.stderr}"
    return result.stdout


def _tracked(pattern: str) -> list[str]:
    return _run("git", "ls-files", "--", *(f"{layer}/{pattern}" for layer in LAYERS), cwd=REPO).split()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    clone = work / "clone"
    _run("git", "clone", "--quiet", "--no-local", str(REPO), clone, cwd=work)
    # No build isolation: setuptools comes from the test venv, so the build needs no network.
    _run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", work / "dist", clone, cwd=work)  # fmt: skip
    (built,) = (work / "dist").glob("liubai-*.whl")
    return built


def test_wheel_holds_every_subpackage_and_stylesheet_and_no_bench_or_tests(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {str(Path(p).parent) for p in _tracked("*__init__.py")}
    assert {"tui/screens", "tui/widgets", "runtime/engine", "agent/cli"} <= packages
    assert {f"{p}/__init__.py" for p in packages} <= names
    stylesheets = set(_tracked("*.tcss"))
    assert "tui/screens/chat.tcss" in stylesheets
    assert stylesheets <= names
    assert "runtime/engine/held_text.txt" in names  # what --weights auto scores formats on
    modules = set(_tracked("*.py"))
    assert modules <= names, sorted(modules - names)
    assert not {n for n in names if n.startswith(("bench/", "tests/"))}


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding only the wheel; the test venv's site-packages lent by a bare .pth line."""
    venv = tmp_path_factory.mktemp("venv") / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=venv.parent)
    python = venv / "bin" / "python"
    pip = (sys.executable, "-m", "pip", "--python", python)
    _run(*pip, "install", "--quiet", "--no-deps", wheel, cwd=venv.parent)
    purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = Path(_run(python, "-c", purelib, cwd=venv).strip())
    (site / "test_venv.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return venv


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def test_the_installed_package_is_the_one_imported(installed: Path, tmp_path: Path) -> None:
    where = _run(installed / "bin" / "python", "-c", "import tui.screens; print(tui.screens.__file__)",
                 cwd=tmp_path, env=_env())  # fmt: skip
    assert Path(where.strip()).is_relative_to(installed), where


def test_liubai_version_runs_from_the_installed_script(installed: Path, tmp_path: Path) -> None:
    out = _run(installed / "bin" / "liubai", "--version", cwd=tmp_path, env=_env())
    assert out.strip() == "liubai 0.1.0"


PILOT = textwrap.dedent(
    """
    import asyncio, sys
    from agent.config import AgentConfig
    from tui.app import LiubaiApp, open_session
    import tui.app

    session = open_session(AgentConfig(model=sys.argv[1], db=sys.argv[2], max_tokens=4, tools=False), None)
    app = LiubaiApp(session)

    async def main() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause()
            print(type(app.screen).__name__, tui.app.__file__)

    asyncio.run(main())
    session.store.close()
    """
)


@pytest.mark.model
def test_the_chat_starts_from_the_installed_package(
    installed: Path, tmp_path: Path, default_model_path: Path
) -> None:
    script = tmp_path / "pilot.py"
    script.write_text(PILOT)
    python = installed / "bin" / "python"
    out = _run(python, script, default_model_path, tmp_path / "chat.db", cwd=tmp_path, env=_env())
    screen, module = out.split()
    assert screen == "ChatScreen"
    assert Path(module).is_relative_to(installed)
