"""Child process for the kill -9 tests: appends groups to a buffer dir forever, one flushed append per
line of output ("ACK <group>"). With `--tear-at N` the N-th frame write stops halfway ("MIDWRITE")
and the process sleeps until it is killed."""

from __future__ import annotations

import argparse
import os
import sys
import time

from streamrl.buffer.config import BufferConfig
from streamrl.buffer.log import SegmentWriter
from streamrl.buffer.store import ReplayBuffer
from tests.buffer.helpers import make_group


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--tear-at", type=int, default=0)
    args = parser.parse_args()
    if args.tear_at:
        original = SegmentWriter.write
        calls = {"n": 0}

        def tearing_write(self, batch):
            calls["n"] += 1
            if self.prefix == "traj" and calls["n"] == args.tear_at:
                if self._data is None:
                    self._open_segment()
                frame = batch.serialize()
                os.write(self._data, frame.to_pybytes()[: frame.size // 2])
                print("MIDWRITE", flush=True)
                time.sleep(600)
            original(self, batch)

        SegmentWriter.write = tearing_write
    buf = ReplayBuffer(BufferConfig(root_dir=args.root, batch_size=2, group_size=2, flush_every_rows=1))
    g = 0
    while True:
        buf.append(make_group(f"g{g:05d}", 2, num_response=64))
        print(f"ACK g{g:05d}", flush=True)
        g += 1


if __name__ == "__main__":
    sys.exit(main())
