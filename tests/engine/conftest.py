"""Engine tests: a deterministic fake model stands in for DeepSeek-V4 (see fake_model.py)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
