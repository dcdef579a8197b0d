"""Sphinx configuration for the eagertp documentation.

Build (warnings are errors, as in CI)::

    python -m sphinx -W --keep-going -b html docs <outdir>
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

import eagertp  # noqa: E402

project = "eagertp"
author = "eagertp contributors"
copyright = "eagertp contributors, BSD-3-Clause"
version = release = eagertp.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "_examples", "_inventories", "Thumbs.db", ".DS_Store"]

# MyST: ``{eval-rst}`` blocks host autodoc; ``colon_fence`` gives ::: admonitions;
# headings get anchors down to level 3 so pages can link to sections.
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# autodoc: eagertp's docstrings are Google style (Args:, Attributes:), read by
# napoleon. ``Attributes:`` become :ivar: fields, not attribute directives: the
# class also documents those names as properties, and two descriptions of one
# object would be a duplicate-object warning.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True

# intersphinx, offline. The build must not touch the network (CI has none, and
# neither do the machines this project is developed on), so instead of
# fetching https://docs.pytorch.org/docs/stable/objects.inv at build time,
# Sphinx reads a small inventory committed next to this file. It lists only
# the torch (and Python) names these pages cross-reference, each with its URL
# under the real documentation site, so links in the built HTML go to
# docs.pytorch.org / docs.python.org as usual. Regenerate it after adding a
# reference: python docs/_inventories/make_inventories.py
intersphinx_mapping = {
    "torch": ("https://docs.pytorch.org/docs/stable/", "_inventories/torch.inv"),
    "python": ("https://docs.python.org/3/", "_inventories/python.inv"),
}

html_theme = "furo"
html_title = f"eagertp {release}"
html_static_path = ["_static"]

