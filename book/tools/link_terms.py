"""Link each chapter's first use of a glossary term to the glossary: {term}`DDP`, {term}`prefetching <prefetch>`.

    python book/tools/link_terms.py            # chapters 3-8: the notebooks 3-4, the generators of 5-8
    python book/tools/link_terms.py --check    # exit 1 if a chapter uses a term first without a link (CI)

Only prose is touched: code, math, headings, links, roles ({glue:text}`...`) and existing links are left alone.
A chapter that already links a term is not linked again. Chapters 5 and 6 are generated (book/tools/make_05.py,
make_06.py), so their generators are edited and the chapters regenerated from them.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

BOOK = Path(__file__).resolve().parents[1]

# The terms chapters 3-6 use from their first pages on (book/glossary.md defines each). Acronyms and names match
# case-sensitively; phrases in any case, with a plural or verb ending.
EXACT = ["DDP", "FSDP", "ZeRO", "DTensor", "DCP", "HSDP", "MFU", "bf16", "NVLink", "InfiniBand", "Stateful"]
PHRASES = ["device mesh", "placement", "prefetch", "reshard", "mixed precision", "micro-batch",
           "gradient accumulation", "activation checkpointing", "bus bandwidth", "meta device", "shard"]

# What is not prose: fenced code, inline code, math, roles and links, and heading lines.
_PROTECTED = re.compile(r"(?s:```.*?```)|(?s:\$\$.*?\$\$)|\$[^$\n]*\$|\{[a-z:]+\}`[^`]*`|`[^`\n]*`"
                        r"|\[[^\]]*\]\([^)]*\)|^#[^\n]*$|<[^>\n]*>", re.M)


def _pattern(term: str) -> re.Pattern:
    if term in EXACT:
        return re.compile(rf"(?<![\w`<-]){re.escape(term)}(?![\w-])")
    return re.compile(rf"(?<![\w`<-])({re.escape(term)})(s|es|ing|ed)?(?![\w-])", re.I)


def link_first(text: str, done: set[str]) -> str:
    """`text` (markdown) with the first prose use of each term not in `done` linked; `done` is updated."""
    out, last = [], 0
    for m in list(_PROTECTED.finditer(text)) + [None]:
        end = m.start() if m else len(text)
        chunk = text[last:end]
        for term in EXACT + PHRASES:
            if term in done:
                continue
            hit = _pattern(term).search(chunk)
            if hit is None:
                continue
            word = hit.group(0)
            role = f"{{term}}`{word}`" if word == term else f"{{term}}`{word} <{term}>`"
            chunk = chunk[:hit.start()] + role + chunk[hit.end():]
            done.add(term)
        out.append(chunk)
        if m:
            out.append(m.group(0))
            last = m.end()
    return "".join(out)


def already_linked(texts: list[str]) -> set[str]:
    found = set()
    for t in texts:
        for m in re.finditer(r"\{term\}`([^`]*)`", t):
            inner = m.group(1)
            found.add(inner.split("<")[-1].rstrip(">").strip() if "<" in inner else inner)
    return found


def notebook(path: Path, write: bool) -> bool:
    nb = json.loads(path.read_text())
    cells = [c for c in nb["cells"] if c["cell_type"] == "markdown"]
    done = already_linked(["".join(c["source"]) for c in cells])
    changed = False
    for c in cells:
        old = "".join(c["source"])
        new = link_first(old, done)
        if new != old:
            changed = True
            c["source"] = new.splitlines(True)
    if changed and write:
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return changed


_MD = re.compile(r'(md\(r""")(.*?)(""")', re.S)


def generator(path: Path, write: bool) -> bool:
    src = path.read_text()
    done = already_linked([m.group(2) for m in _MD.finditer(src)])
    new = _MD.sub(lambda m: m.group(1) + link_first(m.group(2), done) + m.group(3), src)
    if new != src and write:
        path.write_text(new)
    return new != src


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="report chapters with unlinked first uses; change nothing")
    args = p.parse_args()
    targets = [(BOOK / "03_ddp.ipynb", notebook), (BOOK / "04_zero.ipynb", notebook),
               (BOOK / "tools" / "make_05.py", generator), (BOOK / "tools" / "make_06.py", generator),
               (BOOK / "tools" / "make_07.py", generator), (BOOK / "tools" / "make_08.py", generator)]
    stale = [path.name for path, fn in targets if fn(path, write=not args.check)]
    if args.check and stale:
        print("first uses of glossary terms without a link in: " + ", ".join(stale)
              + " (python book/tools/link_terms.py)", file=sys.stderr)
        return 1
    if not args.check:
        print("linked:", ", ".join(stale) or "nothing new")
    return 0


if __name__ == "__main__":
    sys.exit(main())
