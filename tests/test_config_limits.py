"""Config files are bounded input: the reader refuses alias and merge-key bombs (counted without
expanding them), self-referential aliases, nesting past `MAX_DEPTH` and non-UTF-8 bytes, each as a
`ConfigError` naming the file and the limit, in the library and in the CLI (exit 1, not 70)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

import modopt as mo
from modopt.cli import main as cli_main
from modopt.core.configfile import MAX_BYTES, MAX_DEPTH, MAX_NODES, ConfigError, check_limits, parse_text, read_file

LIMIT_NODES = rf"more than {MAX_NODES} values.*MAX_NODES"
LIMIT_DEPTH = rf"{MAX_DEPTH} levels.*MAX_DEPTH"


# --- files that attack the reader -----------------------------------------------------------------
def alias_bomb(levels: int, fanout: int = 10) -> str:
    """Anchors at the top level, each a Chain of `fanout` aliases to the one before: `fanout**levels`
    Identity transforms once expanded, in a few hundred bytes."""
    names = [f"l{i}" for i in range(levels + 1)]
    lines = [f"{names[0]}: &{names[0]} {{type: Identity}}"]
    for prev, name in zip(names, names[1:]):
        lines.append(f"{name}: &{name} {{type: Chain, transforms: [{', '.join(['*' + prev] * fanout)}]}}")
    lines.append(f"transforms: [*{names[-1]}]")
    return "\n".join(lines) + "\n"


def chain_tree(levels: int, fanout: int = 10) -> str:
    """A valid pipeline: one Chain tree, `levels` deep, each level written once (anchored inline) and
    repeated `fanout - 1` times through aliases; `fanout**levels` Identity leaves."""
    node = "&l0 {type: Identity}"
    for i in range(1, levels + 1):
        node = f"&l{i} {{type: Chain, transforms: [{node}, {', '.join([f'*l{i - 1}'] * (fanout - 1))}]}}"
    return f"transforms: [{node}]\n"


def chain_tree_values(levels: int, fanout: int = 10) -> int:
    """Values of `chain_tree(levels)` once expanded: an Identity is a mapping and its type (2), a
    Chain adds its mapping, type and list (3) to its children; the top adds its mapping and list."""
    n = 2
    for _ in range(levels):
        n = 3 + fanout * n
    return 2 + n


def levels(value) -> int:
    """Containers on the first path down `value` (each one's first entry)."""
    n = 0
    while isinstance(value, (list, dict)):
        n += 1
        if not value:
            break
        value = value[0] if isinstance(value, list) else next(iter(value.values()))
    return n


def leaves(transform) -> int:
    inner = getattr(transform, "transforms", None)
    return 1 if inner is None else sum(leaves(t) for t in inner)


def nested(fmt: str, depth: int, kind: str = "list") -> str:
    """A config whose `x` nests `depth` containers below the top-level mapping."""
    if fmt == "json":
        opening, closing = ('[', ']') if kind == "list" else ('{"a": ', '}')
        return '{"x": ' + opening * depth + ("" if kind == "list" else "1") + closing * depth + "}"
    if fmt == "toml":
        opening, closing = ("[", "]") if kind == "list" else ("{a = ", "}")
        return "x = " + opening * depth + ("" if kind == "list" else "1") + closing * depth + "\n"
    opening, closing = ("[", "]") if kind == "list" else ("{a: ", "}")
    return "x: " + opening * depth + ("" if kind == "list" else "1") + closing * depth + "\n"


def write(tmp_path, name: str, text: str | bytes):
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


# --- alias and merge-key bombs --------------------------------------------------------------------
@pytest.mark.parametrize("levels", [6, 9])  # 10**6 and 10**9 transforms: only a count that never expands ends
def test_alias_bomb_is_refused_naming_the_file_and_the_limit(tmp_path, levels):
    path = write(tmp_path, "bomb.yaml", alias_bomb(levels))
    assert len(path.read_bytes()) < 1024  # under a kilobyte of text
    with pytest.raises(ConfigError, match=LIMIT_NODES) as info:
        read_file(path)
    assert str(info.value).startswith(f"{path}: ")
    assert "YAML aliases" in str(info.value)
    with pytest.raises(ConfigError, match=LIMIT_NODES):
        mo.load_config(path)


def test_a_chain_tree_one_level_below_the_limit_loads(tmp_path):
    assert chain_tree_values(4) <= MAX_NODES < chain_tree_values(5)
    path = write(tmp_path, "tree.yaml", chain_tree(4))
    cfg = mo.load_config(path)
    assert leaves(cfg.transforms[0]) == 10**4
    assert all(type(t).__name__ == "Chain" for t in cfg.transforms[0].transforms)
    too_big = write(tmp_path, "tree5.yaml", chain_tree(5))
    with pytest.raises(ConfigError, match=LIMIT_NODES):
        mo.load_config(too_big)


def test_the_node_limit_is_exact_and_counts_every_alias_use():
    leaf = {}
    at_limit = {"x": [leaf] * (MAX_NODES - 2)}  # the mapping, the list, and each use of `leaf`
    assert check_limits(at_limit, "<dict>") is at_limit
    with pytest.raises(ConfigError, match=LIMIT_NODES):
        check_limits({"x": [leaf] * (MAX_NODES - 1)}, "<dict>")
    # a shared mapping counts once per use, with everything inside it
    inner = {"a": 1, "b": [1, 2]}  # 1 + 1 + 1 + 2 = 5 values
    check_limits({"x": [inner] * ((MAX_NODES - 2) // 5)})
    with pytest.raises(ConfigError, match="shared references"):
        check_limits({"x": [inner] * ((MAX_NODES - 2) // 5 + 1)}, aliases=False)


def test_merge_key_bomb_is_refused_inside_the_yaml_loader(tmp_path):
    # `<<: [*a, *a, ...]` makes PyYAML itself copy entry lists tenfold per level, before any check
    # on the parsed data can run; the loader counts the entries first
    lines = ["l0: &l0 {k: 1, j: 2}"]
    for i in range(1, 10):
        lines.append(f"l{i}: &l{i} {{z{i}: 0, <<: [{', '.join([f'*l{i - 1}'] * 10)}]}}")
    path = write(tmp_path, "merge.yaml", "\n".join(lines) + "\n")
    try:
        data = read_file(path)
    except ConfigError as e:  # PyYAML <= 6.0.3 would copy 10**9 entries: the loader refuses first
        assert re.search(LIMIT_NODES, str(e)) and str(e).startswith(f"{path}: ") and "merge keys" in str(e)
    else:  # PyYAML 6.0.4 merges each source once (no blow-up): the result is the merged mapping
        assert data["l9"] == {"z9": 0, **{f"z{i}": 0 for i in range(1, 9)}, "k": 1, "j": 2}


def test_merge_keys_in_a_real_config_load_as_with_safe_load():
    import yaml

    text = (
        "base: &base {a: 1, b: 2, c: {x: 1}}\n"
        "over: &over {b: 3, d: 4}\n"
        "m1: {<<: *base, a: 9}\n"
        "m2: {<<: [*over, *base], e: 5}\n"
        "chain: &chain {<<: *base, z: 1}\n"
        "m3: {<<: [*chain, *over, *chain], q: 0}\n"
    )
    ours, theirs = parse_text(text, "yaml"), yaml.safe_load(text)
    assert ours == theirs
    assert {k: list(v) for k, v in ours.items()} == {k: list(v) for k, v in theirs.items()}  # key order too
    assert ours["m2"] == {"b": 3, "d": 4, "a": 1, "c": {"x": 1}, "e": 5}


def test_shared_anchors_in_a_legitimate_config_load_unchanged(tmp_path):
    import yaml

    text = (
        "transforms:\n"
        "  - &clip {type: ClipNorm, max_norm: 1.0}\n"
        "  - {type: Chain, transforms: [*clip, {type: Adam, lr: 0.001}]}\n"
    )
    path = write(tmp_path, "anchors.yaml", text)
    cfg = mo.load_config(path)
    assert [type(t).__name__ for t in cfg.transforms] == ["ClipNorm", "Chain"]
    assert cfg.transforms[1].transforms[0] == cfg.transforms[0] == mo.ClipNorm(max_norm=1.0)
    data = read_file(path)
    assert data == yaml.safe_load(text)
    assert data["transforms"][0] is data["transforms"][1]["transforms"][0]  # the alias stays shared, not copied


# --- cycles ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, inner, outer",
    [
        ("transforms: &a [*a]\n", "transforms.0", "transforms"),
        ("transforms: [&a {type: Chain, transforms: [*a]}]\n", "transforms.0.transforms.0", "transforms.0"),
        ("&top {transforms: [], defaults: {again: *top}}\n", "defaults.again", "<root>"),
    ],
)
def test_self_referential_alias_is_refused(tmp_path, text, inner, outer):
    path = write(tmp_path, "cycle.yaml", text)
    with pytest.raises(ConfigError, match="contains itself") as info:
        mo.load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    assert f"{inner} is a YAML alias to {outer}" in message


@pytest.mark.parametrize("text", ["a: &a {k: 1, <<: *a}\n", "a: &a {k: 1, <<: [{j: 2, <<: *a}]}\n"])
def test_a_mapping_that_merges_itself_is_refused(tmp_path, text):
    path = write(tmp_path, "merge_cycle.yaml", text)
    with pytest.raises(ConfigError, match="merges a mapping into itself") as info:
        read_file(path)
    assert str(info.value).startswith(f"{path}: ")


def test_in_memory_cycle_and_shared_data_are_checked():
    looped: dict = {"transforms": []}
    looped["transforms"].append(looped)
    cycle = r"^<dict>: the config contains itself: transforms\.0 is a reference to <root>"
    with pytest.raises(ConfigError, match=cycle):
        check_limits(looped, "<dict>", aliases=False)
    # sharing without a cycle is fine, and transforms already built are leaves
    clip = {"type": "ClipNorm", "max_norm": 1.0}
    data = {"transforms": [clip, clip, mo.Adam()]}
    assert check_limits(data) is data


def test_load_config_refuses_an_in_memory_cycle():
    looped: dict = {"type": "Chain", "transforms": []}
    looped["transforms"].append(looped)
    with pytest.raises(ConfigError, match="contains itself"):
        mo.load_config({"transforms": [looped]})


# --- depth -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["yaml", "json", "toml"])
@pytest.mark.parametrize("kind", ["list", "map"])
def test_nesting_up_to_the_limit_parses(fmt, kind):
    data = parse_text(nested(fmt, MAX_DEPTH - 1, kind), fmt)  # the top-level mapping is the first level
    assert levels(data) == MAX_DEPTH


@pytest.mark.parametrize("fmt", ["yaml", "json", "toml"])
@pytest.mark.parametrize("kind", ["list", "map"])
@pytest.mark.parametrize("depth", [MAX_DEPTH, 500, 5000, 100_000])  # the last two overflow the parsers
def test_deep_nesting_is_refused_naming_the_file(tmp_path, fmt, kind, depth):
    if fmt == "yaml" and depth == 100_000:
        depth = 20_000  # PyYAML scans the whole text first; this is already far past its recursion
    path = write(tmp_path, f"deep.{fmt}", nested(fmt, depth, kind))
    with pytest.raises(ConfigError, match=LIMIT_DEPTH) as info:
        read_file(path)
    assert str(info.value).startswith(f"{path}: ")
    with pytest.raises(ConfigError, match=LIMIT_DEPTH):
        mo.load_config(path)


def test_depth_through_aliases_counts_where_the_alias_is_used(tmp_path):
    # each anchor is shallow where it is defined, but every level adds one through the aliases
    lines = ["l0: &l0 []"] + [f"l{i}: &l{i} [*l{i - 1}]" for i in range(1, MAX_DEPTH + 5)]
    path = write(tmp_path, "deep_alias.yaml", "\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=LIMIT_DEPTH):
        read_file(path)
    ok = write(tmp_path, "ok_alias.yaml", "\n".join(lines[: MAX_DEPTH - 1]) + "\n")  # l0..l62: 64 levels
    data = read_file(ok)
    assert levels(data[f"l{MAX_DEPTH - 2}"]) == MAX_DEPTH - 1
    over = write(tmp_path, "over_alias.yaml", "\n".join(lines[:MAX_DEPTH]) + "\n")  # one more level
    with pytest.raises(ConfigError, match=LIMIT_DEPTH):
        read_file(over)


def test_deep_toml_tables_are_refused(tmp_path):
    headers = "\n".join("[" + ".".join(["t"] * k) + "]" for k in range(1, MAX_DEPTH + 2))
    path = write(tmp_path, "tables.toml", headers + "\n")
    with pytest.raises(ConfigError, match=LIMIT_DEPTH):
        read_file(path)


# --- encoding ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, raw",
    [
        ("latin1.yaml", "transforms:\n  - {type: Adam}\n# café\n".encode("latin-1")),
        ("latin1.json", '{"transforms": [{"type": "Adam"}], "note": "café"}'.encode("latin-1")),
        ("utf16.toml", 'transforms = [{type = "Adam"}]\n'.encode("utf-16")),
    ],
)
def test_non_utf8_bytes_are_a_config_error(tmp_path, name, raw):
    path = write(tmp_path, name, raw)
    with pytest.raises(ConfigError, match="not UTF-8") as info:
        mo.load_config(path)
    assert str(info.value).startswith(f"{path}: ")


def test_utf8_text_still_loads(tmp_path):
    path = tmp_path / "utf8.yaml"
    path.write_bytes("# café ✓\ntransforms:\n  - {type: Adam, lr: 0.01}\n".encode("utf-8"))
    assert mo.load_config(path).transforms[0].lr == 0.01


# --- through the CLI: a user error (exit 1) on one line, never "a bug in modopt" (70) ----------------
CLI_CASES = {
    "bomb.yaml": alias_bomb(7),
    "cycle.yaml": "transforms: [&a {type: Chain, transforms: [*a]}]\n",
    "deep.yaml": nested("yaml", 3000),
    "deep.json": nested("json", 100_000),
    "deep.toml": nested("toml", 100_000, "map"),
    "latin1.yaml": "transforms:\n  - {type: Adam}\n# café\n".encode("latin-1"),
}


@pytest.mark.parametrize("name", sorted(CLI_CASES))
def test_cli_validate_reports_a_user_error_naming_the_file(tmp_path, capsys, name):
    path = write(tmp_path, name, CLI_CASES[name])
    assert cli_main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"modopt validate: error: {path}: ")
    assert "internal error" not in err and "Traceback" not in err


def test_cli_subprocess_exit_status_for_an_alias_bomb(tmp_path):
    path = write(tmp_path, "bomb.yaml", alias_bomb(8))
    r = subprocess.run([sys.executable, "-m", "modopt.cli", "validate", str(path)], capture_output=True, text=True)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        f"modopt validate: error: {path}: the config expands to more than {MAX_NODES} values through YAML aliases "
        f"(limit MAX_NODES in modopt/core/configfile.py)"
    ]


# --- size ----------------------------------------------------------------------------------------------
LIMIT_BYTES = rf"more than a config may be \({MAX_BYTES} bytes.*MAX_BYTES"


@pytest.mark.parametrize("fmt", ["yaml", "json", "toml"])
def test_a_config_file_over_the_byte_limit_is_refused_before_parsing(tmp_path, fmt, monkeypatch):
    comment = {"yaml": "#", "json": None, "toml": "#"}[fmt]
    body = {"yaml": "transforms: [{type: Adam}]\n", "json": '{"transforms": [{"type": "Adam"}]}',
            "toml": 'transforms = [{type = "Adam"}]\n'}[fmt]
    pad = MAX_BYTES - len(body) + 1  # one byte over
    text = body + " " * pad if comment is None else body + comment + "x" * (pad - 2) + "\n"
    path = write(tmp_path, f"big.{fmt}", text)
    assert path.stat().st_size == MAX_BYTES + 1
    parsed = []
    monkeypatch.setattr("modopt.core.configfile.load_yaml", lambda t: parsed.append(t))
    with pytest.raises(ConfigError, match=LIMIT_BYTES) as info:
        read_file(path)
    assert str(info.value).startswith(f"{path}: the config is {MAX_BYTES + 1} bytes")
    with pytest.raises(ConfigError, match=LIMIT_BYTES):
        mo.load_config(path)
    assert parsed == []  # refused unread: the parser never saw it
    monkeypatch.undo()
    path.write_text(text[: -2] + "\n")  # at the limit: read
    assert mo.load_config(path).transforms[0] == mo.Adam()


def test_config_text_over_the_byte_limit_is_refused_counting_utf8_bytes():
    wide = "x: '" + "é" * (MAX_BYTES // 2) + "'\n"  # fewer characters than the limit, more bytes
    assert len(wide) < MAX_BYTES < len(wide.encode())
    with pytest.raises(ConfigError, match=rf"^<config>: the config is {len(wide.encode())} bytes"):
        parse_text(wide, "yaml")
    with pytest.raises(ConfigError, match=r"^<config>: the config is over"):
        parse_text("#" * (MAX_BYTES + 1), "yaml")
    assert parse_text("x: '" + "é" * 1000 + "'\n", "yaml") == {"x": "é" * 1000}


def test_cli_validate_refuses_a_60_mib_config_naming_the_file(tmp_path, capsys):
    path = tmp_path / "huge.yaml"
    with path.open("w") as f:  # the reported case: a 60 MiB comment
        f.write("transforms: [{type: Adam}]\n#")
        f.write("x" * (60 * 2**20))
    assert cli_main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert err == (f"modopt validate: error: {path}: the config is {path.stat().st_size} bytes, more than a config "
                   f"may be ({MAX_BYTES} bytes, 2 MiB); not parsed (limit MAX_BYTES in modopt/core/configfile.py)\n")


def test_line_endings_read_as_in_text_mode(tmp_path):
    path = write(tmp_path, "crlf.toml", b'transforms = [{type = "Adam", lr = 0.5}]\r\n# a comment\r\n')
    assert read_file(path) == {"transforms": [{"type": "Adam", "lr": 0.5}]}
    old_mac = write(tmp_path, "cr.toml", b'# a comment\rtransforms = [{type = "Adam"}]\r')
    assert read_file(old_mac) == {"transforms": [{"type": "Adam"}]}
