"""The reserved peak with a pool per stream against one pool, on the published FSDP2 rows (issue #30's check).

The caching allocator keeps a pool per stream, and FSDP2 allocates its all-gather output and its sharded
gradients on streams of their own. This predicts each row of ``benchmarks/published.py`` named on the command line
twice: as the dry run models it, and with every allocation put on one stream, which is what the model did before
it followed streams. Run: ``python benchmarks/streams.py [ROW ...]`` (default: torchtitan's 8B row and the 7B SAC
row of torchtitan's PR #165).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import published

from lightning_memtenants import dry_run
from lightning_memtenants.predict import dryrun

GiB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", nargs="*", default=["titan-8b-fsdp8", "pr165-fsdp2-op-reserved"])
    args = parser.parse_args()
    streams = dryrun.current_stream
    for name in args.rows:
        setup = next((s for s in published.SETUPS if s.name == name), None)
        if setup is None:
            parser.error(f"rows must name rows of benchmarks/published.py, got {name!r}")
        spec = setup.run()
        for label, stream in (("a pool per stream", streams), ("one pool", lambda: None)):
            dryrun.current_stream = stream
            try:
                with published.environment(spec.environ), published.software_of_2022(spec.of_2022):
                    prediction = dry_run(spec.model, spec.batch, **spec.options, allocator=spec.allocator)
            finally:
                dryrun.current_stream = streams
            report = prediction.report
            pools = ", ".join(f"{k} {v / GiB:.2f}" for k, v in prediction.reserved_by_stream_bytes.items())
            print(
                f"{name}, {label}: peak allocated {report.peak_bytes / GiB:.2f} GiB, peak reserved"
                f" {report.peak_reserved_bytes / GiB:.2f} GiB; reserved at the end by stream (GiB): {pools}"
            )


if __name__ == "__main__":
    main()
