"""The suite: a test folder per package folder (docs/internals.md's table); the helpers that
several folders share sit here, beside this file."""

import os

# The repository's root, whatever folder of tests/ a file sits in (scripts run from it).
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
