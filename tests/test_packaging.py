"""Packaging: one version source, the shipped example configs addressed by name, the distribution's name.

Fast checks on the source tree and the installed metadata; building and installing the wheel
for real is `.ci/release-check` (run by CI after the tests).
"""

from __future__ import annotations

import importlib.metadata as md
import re
import sys
from pathlib import Path

import pytest

import modopt
from modopt.cli import examples as ex
from modopt.cli import main
from modopt.config import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CONFIGS = ROOT / "examples" / "configs"
DIST = "torch-modopt"


# --- one version source ------------------------------------------------------------------------
def test_the_version_has_one_source_the_build_reads():
    project = PYPROJECT["project"]
    assert project["name"] == DIST
    assert "version" not in project and "version" in project["dynamic"]
    assert PYPROJECT["tool"]["hatch"]["version"]["path"] == "modopt/__init__.py"
    text = (ROOT / "modopt" / "__init__.py").read_text()
    stated = re.findall(r'^__version__ = "([^"]+)"$', text, re.M)
    assert stated == [modopt.__version__]
    # semantic versioning, PEP 440 pre-releases (docs/releasing.md)
    assert re.fullmatch(r"\d+\.\d+\.\d+((a|b|rc)\d+)?", modopt.__version__), modopt.__version__


def test_the_installed_metadata_and_the_command_agree_with_modopt_version(capsys):
    try:
        installed = md.version(DIST)
    except md.PackageNotFoundError:
        pytest.fail(f"no {DIST} distribution is installed: pip install -e . (the project was renamed from modopt)")
    assert installed == modopt.__version__, (
        f"the installed {DIST} metadata says {installed}, modopt/__init__.py says {modopt.__version__}: "
        "reinstall (pip install -e .)"
    )
    scripts = [e for e in md.distribution(DIST).entry_points if e.group == "console_scripts"]
    assert [(e.name, e.value) for e in scripts] == [("modopt", "modopt.cli:main")]
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"modopt {installed} (torch-modopt)\n"


def test_the_changelog_has_a_section_for_the_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[{re.escape(modopt.__version__)}\] - ", text, re.M), "CHANGELOG.md: no section for the version"


#: an install hint that names the index's `modopt` (CEA's ModOpt), not `torch-modopt`; prose that says what
#: `pip install modopt` does is written "`pip install modopt` installs ..." and is not a hint
WRONG_HINT = re.compile(r"""pip install\s+(?:-\S+\s+)*["']?modopt(?![\w-])(?!` installs)""")


def unnamed_in_changelog(text: str) -> list[str]:
    """Registered modopt transforms the changelog text never names (the release check's rule, here so the fast lane
    finds a missing line before CI's release step does)."""
    from modopt.core.registry import get_transform
    return [n for n in modopt.available() if get_transform(n).__module__.startswith("modopt.")
            and not re.search(rf"\b{n}\b", text)]


def test_the_changelog_names_every_registered_transform():
    missing = unnamed_in_changelog((ROOT / "CHANGELOG.md").read_text(encoding="utf-8"))
    assert not missing, f"CHANGELOG.md does not name {missing} (a line under Added)"


def test_the_changelog_check_sees_a_missing_name():
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert unnamed_in_changelog(re.sub(r"\bSkipNorm\b", "", text)) == ["SkipNorm"]


def test_no_page_or_message_tells_users_to_pip_install_modopt():
    """`pip install modopt` (or `modopt[extra]`) installs CEA's ModOpt, another project: every hint names torch-modopt."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "modopt").rglob("*.py")),
             *sorted((ROOT / "examples").rglob("*.py")), *sorted(CONFIGS.glob("*.yaml"))]
    found = [f"{f.relative_to(ROOT)}:{n}: {line.strip()}" for f in files
             for n, line in enumerate(f.read_text().splitlines(), 1) if WRONG_HINT.search(line)]
    assert found == []


def test_the_hint_check_sees_a_wrong_hint():
    for wrong in ("(pip install 'modopt[plot]')", "pip install -U modopt", 'pip install "modopt[dev]"', "pip install modopt"):
        assert WRONG_HINT.search(wrong), wrong
    for right in ('pip install "torch-modopt[plot]"', "pip install modopt-x", "`pip install modopt` installs CEA's"):
        assert not WRONG_HINT.search(right), right


# --- the wheel's layout and the runtime lookup agree -------------------------------------------
def test_the_wheel_maps_every_example_config_where_the_lookup_reads_it():
    wheel = PYPROJECT["tool"]["hatch"]["build"]["targets"]["wheel"]
    assert wheel["only-include"] == ["modopt", "examples/configs"]
    assert wheel["sources"] == {"examples/configs": "modopt/examples"}
    assert ex.INSTALLED == ROOT / "modopt" / "examples"
    assert ex.CHECKOUT == CONFIGS
    sdist = PYPROJECT["tool"]["hatch"]["build"]["targets"]["sdist"]["include"]
    assert {"/tests", "/docs", "/examples", "/modopt"} <= set(sdist)


def test_every_yaml_in_examples_configs_is_shipped_by_its_name():
    on_disk = {p.name[: -len(p.suffix)]: p for p in CONFIGS.iterdir() if p.name.endswith((".yaml", ".yml"))}
    assert len(on_disk) >= 6
    assert ex.examples_dir() == CONFIGS  # a checkout: no modopt/examples
    assert ex.shipped() == on_disk
    assert list(ex.shipped()) == sorted(on_disk)


# --- find_config: a path that exists, else a shipped name --------------------------------------
def test_a_name_finds_the_shipped_file_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    zclip = CONFIGS / "transformer_zclip.yaml"
    assert ex.find_config("transformer_zclip") == zclip
    assert ex.find_config("transformer_zclip.yaml") == zclip
    assert ex.find_config("muon_adamw") == CONFIGS / "muon_adamw.yaml"


def test_a_path_that_exists_wins_over_a_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "transformer_zclip.yaml").write_text("name: mine\n")
    (tmp_path / "muon_adamw").write_text("name: mine too\n")
    assert ex.find_config("transformer_zclip.yaml") == Path("transformer_zclip.yaml")
    assert ex.find_config("muon_adamw") == Path("muon_adamw")
    assert ex.find_config(str(CONFIGS / "teacher_student.yaml")) == CONFIGS / "teacher_student.yaml"  # the clone's path


def test_paths_that_are_not_names_stay_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for text in ("sub/transformer_zclip", "sub/transformer_zclip.yaml", "transformer_zclip.json", "x.toml"):
        assert ex.find_config(text) == Path(text)


def test_an_unknown_name_lists_the_shipped_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        ex.find_config("transformer_zclp")
    msg = str(e.value)
    assert msg.startswith("transformer_zclp: no such file, and no example config is named 'transformer_zclp'")
    assert "(did you mean 'transformer_zclip'?)" in msg
    assert msg.endswith(", ".join(ex.shipped()))


def test_a_wheel_layout_is_read_first_and_takes_yaml_only(tmp_path, monkeypatch):
    installed = tmp_path / "modopt" / "examples"
    installed.mkdir(parents=True)
    (installed / "a.yaml").write_text("# first line\nname: a\n")
    (installed / "b.yml").write_text("name: bee\n")
    (installed / "notes.txt").write_text("not a config\n")
    (installed / "c.yaml").mkdir()  # a directory is not a config
    monkeypatch.setattr(ex, "INSTALLED", installed)
    assert ex.examples_dir() == installed
    assert ex.shipped() == {"a": installed / "a.yaml", "b": installed / "b.yml"}
    monkeypatch.chdir(tmp_path)
    assert ex.find_config("b") == installed / "b.yml"


def test_without_any_examples_the_error_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(ex, "INSTALLED", tmp_path / "none1")
    monkeypatch.setattr(ex, "CHECKOUT", tmp_path / "none2")
    monkeypatch.chdir(tmp_path)
    assert ex.examples_dir() is None and ex.shipped() == {}
    with pytest.raises(ConfigError, match="none in this installation"):
        ex.find_config("transformer_zclip")
    assert ex.format_examples().startswith("no example configs in this installation")


def test_describe_takes_the_first_sentence_of_the_leading_comment(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_text("# A model on `real` data (task x: no download),\n# with clipping. More words.\n# Run: modopt run x\nname: x\n")
    assert ex.describe(f) == "A model on real data (task x: no download), with clipping."
    f.write_text("#\n# One line only\nname: x\n# a later comment\n")
    assert ex.describe(f) == "One line only"
    f.write_text("name: plain\ntask: {name: transformer}\n")
    assert ex.describe(f) == "experiment 'plain'"


# --- the command line, by name, from another directory -----------------------------------------
def test_examples_lists_every_name_with_its_description(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["examples"]) == 0
    out = capsys.readouterr().out.splitlines()
    names = list(ex.shipped())
    listed = out[: len(names)]
    assert [line.split()[0] for line in listed] == names
    for line, (name, path) in zip(listed, ex.shipped().items()):
        assert line.split(None, 1)[1] == ex.describe(path)
    zclip = next(line for line in listed if line.startswith("transformer_zclip "))
    assert "ZClip: clip norms that are outliers of an EMA of past norms." in zclip


def test_examples_name_prints_the_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["examples", "muon_adamw"]) == 0
    assert capsys.readouterr().out == (CONFIGS / "muon_adamw.yaml").read_text()
    assert main(["examples", "muon_adam"]) == 1
    err = capsys.readouterr().err
    assert "no example config is named 'muon_adam' (did you mean 'muon_adamw'?)" in err and "transformer_zclip" in err


def test_validate_run_and_compare_take_names(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["validate", "muon_adamw"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("muon_adamw: valid experiment config") and "Masked" in out
    out_dir = tmp_path / "r"
    assert main(["run", "transformer_zclip", "--steps", "2", "--out", str(out_dir), "--quiet", "--no-plots"]) == 0
    cfg = (out_dir / "config.yaml").read_text()
    assert "name: transformer-zclip" in cfg and "type: ZClip" in cfg and "steps: 2" in cfg
    assert main(["compare", "transformer_noclip", "transformer_zclip", "--steps", "2", "--out", str(tmp_path / "c"),
                 "--quiet", "--no-plots"]) == 0
    table = capsys.readouterr().out
    assert "transformer-noclip" in table and "transformer-zclip" in table
    assert main(["run", "no_such_example", "--out", str(tmp_path / "x")]) == 1
    assert "no such file, and no example config is named 'no_such_example'" in capsys.readouterr().err
