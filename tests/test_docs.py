"""The docs hold together: every relative link in README.md, CONTRIBUTING.md, CHANGELOG.md,
BENCHMARKS.md and docs/*.md points to a file that exists, every ``#anchor`` to a heading that
exists (GitHub's rule), every ``mlx-voicechat`` command shown in a code block names a real
verb and real options; README's test command is the one CI runs, and README stays short.
External http(s) links are not fetched."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / n for n in ("README.md", "CONTRIBUTING.md", "CHANGELOG.md", "BENCHMARKS.md")]
DOCS += sorted((ROOT / "docs").glob("*.md"))
README_MAX_LINES = 300

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:, ...


def prose_lines(text: str):
    """(line number, line) outside fenced code blocks, with inline code spans blanked."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield n, CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)


def code_blocks(text: str):
    """Each fenced block's lines."""
    block = None
    for line in text.splitlines():
        if FENCE.match(line):
            if block is None:
                block = []
            else:
                yield block
                block = None
        elif block is not None:
            block.append(line)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: the rendered text lower-cased, punctuation dropped except
    hyphens and underscores, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set:
    """The anchors of every heading in ``path`` (repeats get -1, -2, ... as on GitHub)."""
    seen, out = {}, set()
    text = path.read_text(encoding="utf-8")
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m:
            base = slug(m.group(2))
            k = seen.get(base, 0)
            seen[base] = k + 1
            out.add(base if k == 0 else f"{base}-{k}")
    return out


def broken_links(path: Path, root: Path = ROOT) -> list:
    """Every relative link of ``path`` whose file or anchor does not exist, as messages."""
    problems = []
    for n, line in prose_lines(path.read_text(encoding="utf-8")):
        for m in LINK.finditer(line):
            target = m.group(1)
            if not target or EXTERNAL.match(target):
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(root)}:{n}: {target}"
            if not dest.exists():
                problems.append(f"{where}: no such file")
            elif anchor:
                if dest.suffix != ".md":
                    problems.append(f"{where}: an anchor into a file that is not Markdown")
                elif anchor not in anchors(dest):
                    problems.append(f"{where}: no heading with anchor #{anchor}")
    return problems


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert path.exists(), path
    problems = broken_links(path)
    assert not problems, "\n".join(problems)


def test_the_checker_sees_a_missing_file_and_a_wrong_anchor(tmp_path):
    (tmp_path / "b.md").write_text("# B\n\n## `serve`: the Realtime server, at scale\n")
    doc = tmp_path / "a.md"
    doc.write_text(
        "# A\n## Same\n## Same\n"
        "[ok](b.md#serve-the-realtime-server-at-scale) [ok](#same-1) [ok](https://x.example/y)\n"
        "`[in code](nowhere.md)`\n```\n[in a block](nowhere.md)\n# not a heading\n```\n"
        "[gone](missing.md) [bad](b.md#serve) [bad here](#same-2) ![img](b.png)\n"
        "[bad too](#not-a-heading)\n"
    )
    assert [p.split(": ", 1)[1] for p in broken_links(doc, tmp_path)] == [
        "missing.md: no such file",
        "b.md#serve: no heading with anchor #serve",
        "#same-2: no heading with anchor #same-2",
        "b.png: no such file",
        "#not-a-heading: no heading with anchor #not-a-heading",
    ]


def test_github_anchor_rule():
    assert slug("Backends and exactness") == "backends-and-exactness"
    assert slug("Serving at scale") == "serving-at-scale"
    assert slug("Serving: Realtime transcription sessions") == "serving-realtime-transcription-sessions"
    assert slug("`stream`: a file, as if it were live") == "stream-a-file-as-if-it-were-live"
    assert slug("Speech encoder memory, 2026-11-29") == "speech-encoder-memory-2026-11-29"
    assert slug("The codec's tail & MLX_VOICECHAT_BLAS") == "the-codecs-tail--mlx_voicechat_blas"


def _test_command(lines) -> list:
    return [ln.strip() for ln in lines if ln.strip().startswith("python3 -m venv") and "pytest" in ln]


def test_readme_test_command_is_what_ci_runs():
    readme = [ln for block in code_blocks((ROOT / "README.md").read_text()) for ln in block]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert len(_test_command(readme)) == 1, "README shows one test command"
    assert _test_command(readme) == _test_command(ci)


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def shown_commands(path: Path) -> list:
    """Every ``mlx-voicechat ...`` command in a code block of ``path``, continuation lines
    joined and comments dropped, as (verb, [--options])."""
    out = []
    for block in code_blocks(path.read_text(encoding="utf-8")):
        command = None
        for line in block:
            text = re.sub(r"^\$ ", "", line.strip())
            if text.startswith("mlx-voicechat ") or text == "mlx-voicechat":
                command = [text]
                out.append(command)
            elif command is not None and line[:1].isspace() and text:
                command.append(text)  # an indented continuation (after a backslash, or usage)
            else:
                command = None
    result = []
    for parts in out:
        text = " ".join(re.sub(r"(^|\s)#.*$", "", p).rstrip("\\") for p in parts)
        words = text.split()
        verb = words[1] if len(words) > 1 else ""
        result.append((verb, sorted(set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text)))))
    return result


def test_commands_shown_exist():
    from mlx_voicechat.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a.choices, dict))
    problems, readme_verbs = [], set()
    for path in DOCS:
        for verb, options in shown_commands(path):
            if path.name == "README.md":
                readme_verbs.add(verb)
            parser = sub.choices.get(verb)
            if parser is None:
                problems.append(f"{path.name}: mlx-voicechat {verb}: no such verb")
                continue
            known = set(parser._option_string_actions)
            problems += [
                f"{path.name}: mlx-voicechat {verb} {o}: no such option"
                for o in options
                if o not in known
            ]
    assert not problems, "\n".join(problems)
    assert readme_verbs == set(sub.choices), "README shows an example of every verb"


def test_operating_md_lists_every_metrics_series():
    """docs/operating.md's table of series names each one the server records, with its
    Prometheus name (a counter's with ``_total``), and no other."""
    from mlx_voicechat.serve.metrics import PREFIX, SERIES

    text = (ROOT / "docs" / "operating.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `(voicechat_\w+)` \|", text, re.M))
    names = {PREFIX + n + ("_total" if k == "counter" else "") for n, (k, *_) in SERIES.items()}
    assert listed == names
