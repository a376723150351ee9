"""Sphinx configuration of cleanbuf's API reference, generated from the docstrings.

Build it (warnings are errors, as CI builds it)::

    .venv/bin/sphinx-build -W -q docs/api docs/api/_build
"""

import cleanbuf

project = "cleanbuf"
release = cleanbuf.__version__
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
html_theme = "alabaster"
exclude_patterns = ["_build"]
