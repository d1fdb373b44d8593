"""The README and docs/ as a tool: every config key their commands use exists, and they stay user docs.

Parses every fenced shell block of README.md and docs/**/*.md, finds each `section.key=value` override of a
`jobs.generate` / `esp-batch generate` / `jobs.bench` / `esp-batch train-heads` / `esp-batch report` command
and each key of a YAML block, and checks the key against the dataclasses that define that command's config.
Also: the README's length and its GPU-cluster recipe, no run ids or commit hashes, relative links that
resolve, and the config files the commands name.
"""
from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest
import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())  # wherever tests/ nests this file
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").rglob("*.md"))
PAGES = [README, *DOCS]
SHELL_LANGS = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```", re.S | re.M)
OVERRIDE = re.compile(r"^([A-Za-z_][\w]*(?:\.[\w]+)+)=")


def _import_first(*names: str):
    """The first of these `module:attr` names that imports (module paths move; user commands do not)."""
    errors = []
    for name in names:
        module, _, attr = name.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            errors.append(f"{name}: {exc}")
    raise ImportError("; ".join(errors))


def _schemas() -> dict[str, type]:
    from jobs.config import JobConfig

    bench = _import_first("jobs.bench.config:BenchConfig", "jobs.bench_config:BenchConfig")
    train = _import_first("jobs.train.heads:TrainHeadsConfig", "jobs.train.config:TrainHeadsConfig",
                          "jobs.train_heads:TrainHeadsConfig")
    from jobs.train.dmtd import TrainDmtdConfig

    return {"generate": JobConfig, "bench": bench, "train-heads": train, "train-dmtd": TrainDmtdConfig}


def _keys(schema: type) -> tuple[set[str], set[str]]:
    """(every dotted key of a structured config, the keys whose values are free-form dicts)."""
    keys: set[str] = set()
    open_dicts: set[str] = set()

    def walk(node: DictConfig, prefix: str) -> None:
        for name in node.keys():
            key = f"{prefix}{name}"
            keys.add(key)
            child = node._get_node(name)
            if isinstance(child, DictConfig):
                if OmegaConf.get_type(child) is dict:
                    open_dicts.add(key)
                else:
                    walk(child, key + ".")
            elif isinstance(child, ListConfig):
                pass

    walk(OmegaConf.structured(schema), "")
    return keys, open_dicts


def _known(key: str, keys: set[str], open_dicts: set[str]) -> bool:
    return key in keys or any(key.startswith(d + ".") for d in open_dicts)


def _blocks(langs: set[str]):
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            if m.group(1).lower() in langs:
                line = text.count("\n", 0, m.start()) + 2
                yield page, line, m.group(2)


def _commands(block: str):
    """Shell commands of a block: continuations joined, comments dropped, split at && ; | and newlines."""
    joined = re.sub(r"\\\n", " ", block)
    for line in joined.splitlines():
        try:
            lex = shlex.shlex(line, posix=True, punctuation_chars="&;|")
            lex.whitespace_split = True
            lex.commenters = "#"
            tokens = list(lex)
        except ValueError:
            continue
        cmd: list[str] = []
        for tok in tokens + [";"]:
            if tok and set(tok) <= set("&;|"):
                if cmd:
                    yield cmd
                cmd = []
            else:
                cmd.append(tok)


def _kind(cmd: list[str]) -> str | None:
    """Which config a command reads: generate, bench, train-heads, report, or None (not ours)."""
    for i, tok in enumerate(cmd):
        if tok == "-m" and i + 1 < len(cmd):
            mod = cmd[i + 1]
            if mod == "jobs.generate":
                return "generate"
            if mod == "jobs.bench":
                return "bench"
            if mod in ("jobs.train_heads", "jobs.train"):
                return "train-heads"
            if mod == "jobs.train_dmtd":
                return "train-dmtd"
        if tok.endswith("esp-batch") and i + 1 < len(cmd):
            sub = cmd[i + 1]
            return sub if sub in ("generate", "train-heads", "train-dmtd", "report") else None
    return None


def _overrides():
    for page, line, block in _blocks(SHELL_LANGS):
        for cmd in _commands(block):
            kind = _kind(cmd)
            if kind is None:
                continue
            for tok in cmd:
                m = OVERRIDE.match(tok)
                if m:
                    yield page, line, kind, m.group(1), " ".join(cmd)[:120]


OVERRIDES = list(_overrides())


def test_the_docs_have_commands_with_overrides():
    assert any(p == README for p, *_ in OVERRIDES), "README shows no key=value override"
    assert {k for _, _, k, _, _ in OVERRIDES} >= {"generate", "bench"}


@pytest.mark.parametrize(
    "page,line,kind,key,cmd", OVERRIDES, ids=[f"{p.relative_to(ROOT)}:{ln}:{key}" for p, ln, _, key, _ in OVERRIDES]
)
def test_every_override_names_a_config_key(page, line, kind, key, cmd):
    if kind == "report":
        assert key in ("storage.endpoint", "storage.region", "storage.anonymous"), (
            f"{page.name}:{line}: esp-batch report takes only storage.* keys, not {key} ({cmd})")
        return
    keys, open_dicts = _keys(_schemas()[kind])
    assert _known(key, keys, open_dicts), f"{page.name}:{line}: unknown {kind} key {key!r} in: {cmd}"


def _flatten(d: dict, prefix: str = ""):
    for k, v in d.items():
        key = f"{prefix}{k}"
        yield key
        if isinstance(v, dict):
            yield from _flatten(v, key + ".")


def test_every_yaml_block_of_a_job_config_uses_known_keys():
    schemas = _schemas()
    job_sections = set(_keys(schemas["generate"])[0])
    checked = 0
    for page, line, block in _blocks({"yaml", "yml"}):
        try:
            doc = yaml.safe_load(block)
        except yaml.YAMLError:
            continue
        if not isinstance(doc, dict) or not set(doc) & {"model", "engine", "generation", "data"}:
            continue  # not a job config (e.g. a cluster-launcher snippet)
        if set(doc) - job_sections - {"bench"}:
            continue  # another tool's YAML that happens to have a `data` key
        keys, open_dicts = _keys(schemas["bench" if "bench" in doc else "generate"])
        for key in _flatten(doc):
            assert _known(key, keys, open_dicts), f"{page.name}:{line}: unknown key {key!r} in a YAML block"
        checked += 1
    assert checked >= 1, "no YAML config block found in the docs"


def test_config_files_named_by_commands_exist_and_use_known_keys():
    named = sorted({m for p in PAGES for m in re.findall(r"\bconfigs/[\w.-]+\.yaml\b", p.read_text())})
    assert named, "the docs name no preset under configs/"
    if any("_bc" in p.name for p in (ROOT / "configs").glob("*.yaml")) and not all(
            (ROOT / n).exists() for n in named):
        pytest.skip("configs/ still holds the per-block-size presets; the docs name the per-model ones")
    keys, open_dicts = _keys(_schemas()["generate"])
    for name in named:
        path = ROOT / name
        assert path.is_file(), f"{name} is named in the docs but does not exist"
        for key in _flatten(yaml.safe_load(path.read_text()) or {}):
            assert _known(key, keys, open_dicts), f"{name}: unknown key {key!r}"


def test_readme_is_user_documentation_of_at_most_350_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= 350, f"README.md has {len(lines)} lines"
    headings = [ln for ln in lines if ln.startswith("#")]
    assert any(re.search(r"own model.*GPU.*cluster", h, re.I) for h in headings), (
        "README needs one section on running your own model on a GPU (Ray) cluster")
    assert any(re.search(r"\btau\b.*mean acceptance length|mean acceptance length.*\btau\b", ln, re.I)
               for ln in lines[:120]), "tau must be defined near the top (in the quickstart)"


RUN_ID = re.compile(r"outputs/bench[^\s`'\")]*-v\d+\b|(?<![\w./-])-v\d+\b")
COMMIT = re.compile(r"(?<![0-9A-Za-z_./-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![0-9A-Za-z_])")
NARRATIVE = re.compile(r"\bissue \d+|\bsession of\b|\bthis session\b", re.I)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_no_run_ids_commit_hashes_or_session_logs(page):
    text = page.read_text()
    for pattern, what in ((RUN_ID, "run id"), (COMMIT, "commit hash"), (NARRATIVE, "history narrative")):
        hits = [m.group(0) for m in pattern.finditer(text)]
        assert not hits, f"{page.relative_to(ROOT)}: {what} {hits[:5]}"


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page):
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+://|^mailto:", target):
            continue
        assert (page.parent / target).exists(), f"{page.relative_to(ROOT)}: broken link {target}"


def _leaves(schema: type) -> list[str]:
    keys, open_dicts = _keys(schema)
    parents = {k.rpartition(".")[0] for k in keys}
    return sorted(k for k in keys if "." in k and (k not in parents or k in open_dicts))


@pytest.mark.parametrize("kind,page,skip", [
    ("generate", "docs/guide/configuration.md", ()),
    ("bench", "docs/guide/benchmarking.md", ("model.", "storage.", "data.", "engine.", "generation.", "output.",
                                             "ray.", "fault.")),
    ("train-heads", "docs/guide/training-heads.md", ("model.",)),
    ("train-dmtd", "docs/methods/dmtd.md", ("model.",)),
])
def test_the_reference_pages_document_every_key(kind, page, skip):
    text = (ROOT / page).read_text()
    missing = [k for k in _leaves(_schemas()[kind]) if not k.startswith(skip) and f"`{k}`" not in text]
    assert not missing, f"{page} does not document {missing}"


def test_every_job_and_bench_command_loads_as_a_config():
    """Values too: each generate / bench command's overrides (and its config file, where it exists) load and
    validate as that command would load them."""
    from jobs.config import ConfigError, load_config

    load_bench = _import_first("jobs.bench.config:load_bench_config", "jobs.bench_config:load_bench_config")
    problems, checked = [], 0
    for page, line, block in _blocks(SHELL_LANGS):
        for cmd in _commands(block):
            kind = _kind(cmd)
            if kind not in ("generate", "bench"):
                continue
            overrides = [tok for tok in cmd if OVERRIDE.match(tok)]
            files = [tok for tok in cmd if tok.endswith(".yaml") and (ROOT / tok).is_file()]
            try:
                (load_config if kind == "generate" else load_bench)(str(ROOT / files[0]) if files else None, overrides)
            except ConfigError as exc:
                problems.append(f"{page.relative_to(ROOT)}:{line}: {exc} in: {' '.join(cmd)[:120]}")
            checked += 1
    assert checked >= 10 and not problems, "\n".join(problems)
