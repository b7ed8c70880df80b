"""Run a snippet in a fresh Python whose address space is capped just above what its imports took: a regression that
allocates without bound (a config's sizes, a read of /dev/zero) ends in MemoryError, not in a machine out of memory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CAP = """
import re as _re, resource as _resource
_vm = int(_re.search(r"VmSize:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
_resource.setrlimit(_resource.RLIMIT_AS, (_vm + {headroom}, _vm + {headroom}))
"""


def run_capped(imports: str, body: str, headroom_mb: int = 1024, timeout: float = 300) -> subprocess.CompletedProcess:
    """`imports`, then a cap of `headroom_mb` MiB more address space, then `body`; stdout and stderr captured."""
    code = imports + CAP.format(headroom=headroom_mb << 20) + body
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )
