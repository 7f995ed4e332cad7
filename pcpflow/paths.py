"""Where pcpflow's files are: the ground floor (imports nothing of pcpflow).

Installed, the YAML configs are the package data ``pcpflow.conf`` and the built-in stages
the subpackage ``pcpflow.stages``. A source checkout (on PYTHONPATH, or installed
editable) keeps them as the top-level folders ``conf/`` and ``stages/``; ``pcpflow``'s
package path then includes the checkout root, so the same names import in both.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def checkout_root() -> Path | None:
    """The source checkout this package was imported from, or None when installed."""
    root = PACKAGE_DIR.parent
    marker = root / "pyproject.toml"
    if not (marker.is_file() and (root / "stages" / "__init__.py").is_file()):
        return None
    # NOTE: site-packages could hold some other project's pyproject.toml; only ours counts.
    return root if 'name = "pcpflow"' in marker.read_text() else None


def conf_dir() -> str:
    """The directory of the Hydra configs (``config.yaml`` and the group folders)."""
    import pcpflow.conf as conf  # type: ignore[import-not-found]

    return str(Path(conf.__file__).resolve().parent)


def repo_file(relative: str) -> Path | None:
    """A file of the source checkout (e.g. ``scripts/data/...``), or None when installed."""
    root = checkout_root()
    return None if root is None else root / relative
