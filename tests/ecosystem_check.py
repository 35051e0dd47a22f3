"""One fit under ``lightning.pytorch`` or ``pytorch_lightning`` in a fresh process, printed as JSON.

The live-tensor tracker counts every tensor the process holds, as the CUDA allocator would; two fits compared
to the byte must each start from the same process, not one after the other in a test worker.
Run: ``python tests/ecosystem_check.py PACKAGE DIR``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from test_ecosystem import outcome


def main() -> None:
    package, directory = sys.argv[1], Path(sys.argv[2])
    done = outcome(package, directory)
    for key in ("first", "latest"):
        done[key] = done[key].to_dict()
    done["logged"] = [[step, values] for step, values in done["logged"]]
    print(json.dumps(done))


if __name__ == "__main__":
    main()
