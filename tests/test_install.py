"""A fresh install works: no top-level import name of ours is one that an installed distribution provides (our
``kernels/`` once shadowed Hugging Face's ``kernels``, which transformers imports on every model load), and
requirements.txt is the exact, fully pinned lock of requirements.in."""
import importlib.metadata
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def our_top_level_names(root: Path = ROOT) -> set[str]:
    """Every name ``import NAME`` can find in the repository root (first on ``sys.path`` for ``streamlit run``,
    ``python -m pytest`` and ``python -m lab``): modules, packages, and folders of Python files, which import as
    namespace packages."""
    names = {path.stem for path in root.glob("*.py")}
    for folder in root.iterdir():
        if folder.is_dir() and not folder.name.startswith(".") and any(folder.rglob("*.py")):
            names.add(folder.name)
    return names


def shadowed(ours: set[str], provided: dict[str, list[str]]) -> list[str]:
    """One line per name of ours that an installed distribution also provides, naming both sides."""
    return [f"our top-level '{name}' ({name}/ or {name}.py in the repository) is also provided by the installed "
            f"distribution(s) {', '.join(sorted(set(provided[name])))}" for name in sorted(ours & provided.keys())]


def test_no_name_of_ours_is_an_installed_distribution_s():
    provided = importlib.metadata.packages_distributions()
    assert not shadowed(our_top_level_names(), provided), "\n".join(shadowed(our_top_level_names(), provided))


def test_the_check_names_both_sides_of_a_clash(tmp_path):
    """A distribution that provides one of our names (as Hugging Face's ``kernels`` did) fails the check."""
    (tmp_path / "lab").mkdir()
    (tmp_path / "lab" / "__init__.py").write_text("")
    (tmp_path / "app.py").write_text("")
    (tmp_path / "docs").mkdir()
    assert our_top_level_names(tmp_path) == {"lab", "app"}
    [line] = shadowed({"lab", "app"}, {"lab": ["some-lab-dist"], "numpy": ["numpy"]})
    assert "'lab'" in line and "some-lab-dist" in line


def test_our_kernel_package_is_not_hugging_face_s():
    import paged_kernels

    assert Path(paged_kernels.__file__).resolve().parent == ROOT / "paged_kernels"
    assert not (ROOT / "kernels").exists(), "a top-level kernels/ shadows Hugging Face's kernels package"


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            match = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
            assert match, f"{path.name}: '{line}' is not an exact pin (NAME==VERSION)"
            pins[match[1].lower().replace("_", "-")] = match[2]
    return pins


def test_requirements_txt_pins_every_direct_dependency_exactly():
    pins = _pins(ROOT / "requirements.txt")
    direct = [re.split(r"[<>=!~ ]", line.strip())[0].lower() for line in (ROOT / "requirements.in").read_text()
              .splitlines() if line.strip() and not line.startswith("#")]
    assert set(direct) <= pins.keys(), f"not pinned: {sorted(set(direct) - pins.keys())}"
    assert pins["torch"] == "2.13.0", "torch is pinned without a local suffix (+cpu): a GPU machine gets CUDA's build"
    assert not any(name.startswith("nvidia-") for name in pins), "the lock is resolved against the CPU torch wheel"


def test_the_running_environment_is_the_lock():
    """The suite runs on exactly the pinned set (CI installs it into a fresh virtual environment)."""
    wrong = []
    for name, version in _pins(ROOT / "requirements.txt").items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            wrong.append(f"{name}: not installed (lock {version})")
            continue
        if installed.split("+")[0] != version:
            wrong.append(f"{name}: installed {installed}, lock {version}")
    assert not wrong, "pip install -r requirements.txt gives another set:\n" + "\n".join(wrong)
