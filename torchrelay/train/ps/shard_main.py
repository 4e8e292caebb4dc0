"""Entry point of a shard child process: ``python -m torchrelay.train.ps.shard_main READY_FD`` (config JSON on stdin).

Started only by ``server.serve_shard_supervised``; serves until every worker is done.
"""
import sys

from torchrelay.train.ps.server import _shard_process_main

if __name__ == "__main__":
    _shard_process_main(int(sys.argv[1]))
