"""A Sphinx extension for the book: the repository's address, read from `[project.urls]` in pyproject.toml.

It fills in `@REPOSITORY_URL@` in the pages' sources (code blocks included) and sets the theme's repository and
launch (Colab, Binder) buttons, so that the address is written in one place only. It also drops scripts that
Jupyter Book 1.0.4 adds to every page twice (sphinx-thebe's and sphinx-togglebutton's inline set-up): declared
twice, `const THEBE_JS_URL` is a JavaScript error on every page.
"""
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "@REPOSITORY_URL@"


def repository_url() -> str:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return meta["project"]["urls"]["Repository"].rstrip("/")


def _config_inited(app, config) -> None:
    url = repository_url()
    options = dict(config.html_theme_options or {})
    options.update(repository_url=url, repository_branch="main", path_to_docs="book", use_repository_button=True,
                   launch_buttons={"colab_url": "https://colab.research.google.com",
                                   "binderhub_url": "https://mybinder.org", "notebook_interface": "jupyterlab"})
    config.html_theme_options = options


def _source_read(app, docname, source) -> None:
    source[0] = source[0].replace(TOKEN, repository_url())


def _drop_repeated_scripts(app, pagename, templatename, context, doctree) -> None:
    seen, kept = set(), []
    for script in context.get("script_files", []):
        name = getattr(script, "filename", script) or ""  # an inline script's is None or "": the same thing
        key = (str(name), tuple(sorted(getattr(script, "attributes", {}).items())))
        if key not in seen:
            seen.add(key)
            kept.append(script)
    context["script_files"] = kept


def setup(app):
    app.connect("config-inited", _config_inited)
    app.connect("source-read", _source_read)
    app.connect("html-page-context", _drop_repeated_scripts, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
