"""Writes book/api.md: the reference of nanodist's public API, generated from the docstrings.

    python book/tools/make_api.py            # rewrite book/api.md
    python book/tools/make_api.py --check    # exit 1 if book/api.md is not what the docstrings give (CI)

Every name `import nanodist` exports is on the page (tests/test_book_rules.py checks it), with its signature and
its docstring, and for a class each public method's. Docstrings are shown as written, in literal blocks: they
are plain text with indented examples, not reStructuredText, so the page needs no Sphinx extension and no
docstring can break the strict build.
"""
from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import nanodist  # noqa: E402

PAGE = ROOT / "book" / "api.md"

# The page's sections, in reading order: (title, what it holds, names of nanodist's public API).
SECTIONS = [
    ("Start a run and launch one", "From a script under torchrun, or from a notebook.",
     ["init", "shutdown", "dist_info", "DistInfo", "DistConfigError", "get_rank", "get_world_size", "print0",
      "get_logger", "seed_everything", "launch", "LaunchResult", "LaunchError", "LaunchTimeout"]),
    ("Wrappers", "Data parallelism (Chapter 3) and fully sharded data parallelism (Chapter 5).",
     ["DDP", "NaiveDDP", "FSDP"]),
    ("Optimizers", "Sharded optimizers (Chapter 4): each rank updates only its own part of the state.",
     ["DistAdamW", "DistMuon", "ZeroOptimizer"]),
    ("Tensor parallelism",
     "Chapter 9: one layer's matrices split across ranks, Megatron-style, and the sequence between them.",
     ["tensor_parallel", "ColumnParallelLinear", "RowParallelLinear", "record_traffic"]),
    ("Training", "The one training loop every lab shares.", ["Trainer", "TrainConfig"]),
    ("Checkpoints", "Chapter 6: atomic, checksummed, full or sharded, resumable at any world size.",
     ["CheckpointManager", "CheckpointError", "load_checkpoint"]),
    ("Groups and meshes", "Process groups and device meshes as nanodist uses them.", ["Group", "Mesh"]),
    ("Results", "What a lab writes and the notebooks read.", ["Recorder"]),
    ("Modules", "Submodules exported for convenience; each has its own docstring.",
     ["check", "data", "faults", "model"]),
]


class _Bare(str):
    """An annotation kept as the text it was written as (the modules use `from __future__ import annotations`),
    shown without the quotes inspect would put around a string."""

    def __repr__(self) -> str:
        return str(self)


def signature(obj) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    bare = lambda a: _Bare(a) if isinstance(a, str) else a  # noqa: E731
    params = [p.replace(annotation=bare(p.annotation)) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=bare(sig.return_annotation)))


def doc(obj) -> str:
    text = inspect.getdoc(obj) or "(no docstring)"
    return "```text\n" + text.rstrip() + "\n```\n"


def public_methods(cls) -> list[tuple[str, object]]:
    out = []
    for name, member in cls.__dict__.items():
        if name.startswith("_"):
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if isinstance(member, property):
            out.append((name, member))
        elif inspect.isfunction(member):
            out.append((name, member))
    return out


def entry(name: str) -> str:
    obj = getattr(nanodist, name)
    if inspect.ismodule(obj):
        return f"### `nanodist.{name}`\n\n" + doc(obj)
    if inspect.isclass(obj):
        kind = "exception" if issubclass(obj, BaseException) else "class"
        parts = [f"### `nanodist.{name}{signature(obj) if kind == 'class' else ''}`\n\n*{kind}*\n\n", doc(obj)]
        for mname, member in public_methods(obj):
            if isinstance(member, property):
                parts.append(f"\n#### `.{mname}` (property)\n\n" + doc(member))
            else:
                parts.append(f"\n#### `.{mname}{signature(member)}`\n\n" + doc(member))
        return "".join(parts)
    return f"### `nanodist.{name}{signature(obj)}`\n\n" + doc(obj)


def render() -> str:
    listed = [n for _, _, names in SECTIONS for n in names]
    missing = sorted(set(nanodist.__all__) - set(listed))
    if missing:
        raise SystemExit(f"make_api: {', '.join(missing)} exported by nanodist but on no section of the page")
    out = ["# API reference\n\n",
           "What `import nanodist as nd` gives you, generated from the docstrings by `book/tools/make_api.py` "
           "(the test suite checks that this page is current). The rest of the package (`nanodist.costmodel`, "
           "`nanodist.memory`, `nanodist.collectives`, ...) is imported by name, as the chapters do.\n"]
    for title, blurb, names in SECTIONS:
        out.append(f"\n## {title}\n\n{blurb}\n\n")
        out.append("\n".join(entry(n) for n in names))
    return "".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare with book/api.md instead of writing it")
    args = p.parse_args()
    text = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print("book/api.md is out of date: run python book/tools/make_api.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
