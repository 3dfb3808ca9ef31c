"""Makes the synthetic records in synthetic_records.py importable (pytest runs in importlib mode)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
