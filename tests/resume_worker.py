"""One rank of the data-parallel resume test: `torchrun --nproc-per-node 2 tests/resume_worker.py CRASH_AT ARGS...`
runs `compress ARGS...`, every rank stopping (as a kill would) when it is about to read block CRASH_AT of the
streamed model (-1: never)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compress.cli.commands import main  # noqa: E402
from compress.pipeline.streamed import StreamedBlocks  # noqa: E402

if __name__ == "__main__":
    crash_at, args = int(sys.argv[1]), sys.argv[2:]
    load = StreamedBlocks.load

    def crashing(self, i, device):
        if i == crash_at:
            raise KeyboardInterrupt
        return load(self, i, device)

    StreamedBlocks.load = crashing
    sys.exit(main(args))
